"""A small decoder with seeded random weights: embedding, decoder layers (RMSNorm, attention with rotary
embedding, SwiGLU MLP, residuals), final norm, LM head.

forward() runs one span of consecutive positions of one sequence. The engine only ever passes spans that lie
inside one block, so every position's K/V is computed by the same sequence of kernels with the same shapes
however the prompt was chunked or resumed: a prefill resumed at a block boundary is bitwise the prefill it
replaces.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .config import FULL, EngineConfig
from .pools import PagedKV, RingStates


class Layer:
    def __init__(self, kind: str, index: int, weights: dict[str, torch.Tensor]) -> None:
        self.kind = kind
        self.index = index  # among the layers of its kind: the paged pool's or the rings' layer index
        self.w = weights


class Model:
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        c = config
        self.config = c
        gen = torch.Generator(device="cpu").manual_seed(c.seed)
        inter = c.intermediate or 2 * c.hidden
        qkv = c.heads * c.head_dim

        def rand(*shape: int, scale: float) -> torch.Tensor:
            # Drawn on the CPU in float32 so a seed gives the same weights on every device and dtype.
            return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=c.torch_dtype)

        def norm_weight() -> torch.Tensor:
            return (1.0 + 0.1 * torch.randn(c.hidden, generator=gen)).to(device=device, dtype=c.torch_dtype)

        self.embed = rand(c.vocab, c.hidden, scale=1.0)
        self.layers: list[Layer] = []
        counts = {kind: 0 for kind in set(c.layer_kinds)}
        for kind in c.layer_kinds:
            w = {
                "attn_norm": norm_weight(),
                "wq": rand(c.hidden, qkv, scale=1 / math.sqrt(c.hidden)),
                "wk": rand(c.hidden, qkv, scale=1 / math.sqrt(c.hidden)),
                "wv": rand(c.hidden, qkv, scale=1 / math.sqrt(c.hidden)),
                "wo": rand(qkv, c.hidden, scale=1 / math.sqrt(qkv)),
                "mlp_norm": norm_weight(),
                "w_gate": rand(c.hidden, inter, scale=1 / math.sqrt(c.hidden)),
                "w_up": rand(c.hidden, inter, scale=1 / math.sqrt(c.hidden)),
                "w_down": rand(inter, c.hidden, scale=1 / math.sqrt(inter)),
            }
            self.layers.append(Layer(kind, counts[kind], w))
            counts[kind] += 1
        self.final_norm = norm_weight()
        self.lm_head = rand(c.hidden, c.vocab, scale=1 / math.sqrt(c.hidden))
        half = c.head_dim // 2
        self.inv_freq = 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float32, device=device) / half))
        self.scale = 1.0 / math.sqrt(c.head_dim)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * weight

    def _rotary(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        angles = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        xf = x.float()
        x1, x2 = xf.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_pos: torch.Tensor,
        k_pos: torch.Tensor,
        window: int | None,
    ) -> torch.Tensor:
        """q [T, H, D] over k, v [Tk, H, D]; causal, and limited to keys >= p - window when window is set."""
        scores = torch.matmul(q.transpose(0, 1), k.permute(1, 2, 0)).float() * self.scale  # [H, T, Tk]
        allowed = k_pos[None, :] <= q_pos[:, None]
        if window is not None:
            allowed &= k_pos[None, :] >= q_pos[:, None] - window
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1).to(v.dtype)
        return torch.matmul(probs, v.transpose(0, 1)).transpose(0, 1).flatten(1)  # [T, H*D]

    def forward(
        self,
        token_ids: list[int],
        start: int,
        pages: PagedKV,
        block_table: list[int],
        block_ids: torch.Tensor,
        rings: RingStates | None,
        state_id: int | None,
        wait_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Run positions [start, start + len(token_ids)) (all in one block), write their K/V into the pools,
        and return the logits of the last position [vocab]. block_ids is block_table as a tensor on the device.
        wait_layer(l) is called before full-attention layer l (paged-pool index) touches its K/V."""
        c = self.config
        end = start + len(token_ids)
        device = self.embed.device
        ids = torch.tensor(token_ids, dtype=torch.long, device=device)
        q_pos = torch.arange(start, end, device=device)
        block_id = block_table[start // c.block_size]
        x = self.embed.index_select(0, ids)
        for layer in self.layers:
            w = layer.w
            h = self._rms_norm(x, w["attn_norm"])
            q = self._rotary((h @ w["wq"]).view(-1, c.heads, c.head_dim), q_pos)
            k = self._rotary((h @ w["wk"]).view(-1, c.heads, c.head_dim), q_pos)
            v = (h @ w["wv"]).view(-1, c.heads, c.head_dim)
            if layer.kind == FULL:
                if wait_layer is not None:
                    wait_layer(layer.index)
                pages.write(layer.index, block_id, start % c.block_size, k, v)
                keys, values = pages.gather(layer.index, block_ids[: (end - 1) // c.block_size + 1], end)
                k_pos = torch.arange(0, end, device=device)
                attn = self._attend(q, keys, values, q_pos, k_pos, None)
            else:
                assert rings is not None and state_id is not None
                first = max(0, start - c.window)
                past_k, past_v = rings.gather(state_id, layer.index, first, start)
                keys, values = torch.cat((past_k, k)), torch.cat((past_v, v))
                k_pos = torch.arange(first, end, device=device)
                attn = self._attend(q, keys, values, q_pos, k_pos, c.window)
                rings.write(state_id, layer.index, start, k, v)
            x = x + attn @ w["wo"]
            h = self._rms_norm(x, w["mlp_norm"])
            x = x + (torch.nn.functional.silu(h @ w["w_gate"]) * (h @ w["w_up"])) @ w["w_down"]
        return self._rms_norm(x[-1:], self.final_norm)[0] @ self.lm_head
