//! Compiles the CUDA copy kernel in `cuda/` when nvcc can be found, and links the CUDA runtime statically.
//!
//! nvcc is looked for in this order: `NVCC`, `$CUDA_HOME/bin/nvcc`, the `nvidia-cuda-nvcc` wheel importable by the
//! build Python (`nvidia/cu13/bin/nvcc`; pip's isolated build environment puts the build requirements there), then
//! `PATH`. `KVTIER_NO_CUDA=1` builds without CUDA. Without nvcc, a build with the `require-cuda` feature (which
//! the Python bindings, bindings/python, turn on: a wheel) for Linux x86_64 fails with a message saying so; other
//! builds go on without the kernel: the `kvtier_cuda` cfg is then off and the module reports CUDA unavailable at
//! run time.
use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

const CUDA_SOURCES: &[&str] = &["cuda/copy.cu"];

fn main() {
    println!("cargo::rustc-check-cfg=cfg(kvtier_cuda)");
    for var in ["NVCC", "CUDA_HOME", "KVTIER_NO_CUDA", "PYO3_PYTHON", "PYTHON_SYS_EXECUTABLE", "PYTHONPATH", "PATH"] {
        println!("cargo::rerun-if-env-changed={var}");
    }
    for src in CUDA_SOURCES {
        println!("cargo::rerun-if-changed={src}");
    }
    println!("cargo::rerun-if-changed=cuda/copy.h");

    if env::var("KVTIER_NO_CUDA").is_ok_and(|v| v == "1") {
        println!("cargo::warning=KVTIER_NO_CUDA=1: building without the CUDA copy kernel");
        return;
    }
    let Some((nvcc, source)) = find_nvcc() else {
        let msg = "nvcc not found (looked at NVCC, CUDA_HOME, the nvidia-cuda-nvcc wheel on the build Python's import \
                   path, PATH)";
        // A wheel for Linux x86_64 without the kernel would be a silent downgrade for every user of it: refuse,
        // unless a CPU-only build is asked for. Plain cargo builds (tests, benches, lints) only warn.
        let wheel = env::var_os("CARGO_FEATURE_REQUIRE_CUDA").is_some();
        let linux_x86_64 = env::var("CARGO_CFG_TARGET_OS").is_ok_and(|v| v == "linux")
            && env::var("CARGO_CFG_TARGET_ARCH").is_ok_and(|v| v == "x86_64");
        if wheel && linux_x86_64 {
            panic!(
                "{msg}: the wheel would have no CUDA copy kernel. Install the build requirements (pip does), set \
                    NVCC or CUDA_HOME, or set KVTIER_NO_CUDA=1 for a CPU-only build."
            );
        }
        println!("cargo::warning={msg}: building without the CUDA copy kernel");
        return;
    };
    let root = nvcc.parent().and_then(Path::parent).expect("nvcc lives in <cuda>/bin").to_path_buf();
    let lib_dir = ["lib64", "lib", "targets/x86_64-linux/lib"]
        .iter()
        .map(|d| root.join(d))
        .find(|d| d.join("libcudart_static.a").exists());
    let Some(lib_dir) = lib_dir else {
        println!("cargo::warning=libcudart_static.a not found next to {}: building without CUDA", nvcc.display());
        return;
    };

    // nvcc is run directly (cc's GNU flags are not nvcc's); cc only archives the objects.
    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let mut archive = cc::Build::new();
    for src in CUDA_SOURCES {
        let obj = out_dir.join(Path::new(src).with_extension("o").file_name().expect("file name"));
        let status = Command::new(&nvcc)
            .args(["-c", src, "-o"])
            .arg(&obj)
            .args(["-std=c++17", "-O3", "-Xcompiler=-fPIC", "-Icuda"])
            // Native code for Ampere and Hopper, plus PTX so newer GPUs can JIT it.
            .args([
                "-gencode=arch=compute_80,code=sm_80",
                "-gencode=arch=compute_90,code=sm_90",
                "-gencode=arch=compute_90,code=compute_90",
            ])
            .status()
            .unwrap_or_else(|e| panic!("running {}: {e}", nvcc.display()));
        assert!(status.success(), "nvcc failed on {src}");
        archive.object(obj);
    }
    archive.compile("kvtier_cuda");

    println!("cargo::rustc-link-search=native={}", lib_dir.display());
    println!("cargo::rustc-link-lib=static=cudart_static");
    // The static runtime needs these; libstdc++ for the C++ runtime pieces of the kernel object.
    for lib in ["stdc++", "dl", "rt", "pthread"] {
        println!("cargo::rustc-link-lib=dylib={lib}");
    }
    println!("cargo::rustc-cfg=kvtier_cuda");
    // What built the kernel, kept in the module: nvcc's version and where it was found, not its path (pip's
    // isolated build environment, where the wheel's nvcc usually lives, is gone once the build is done).
    println!("cargo::rustc-env=KVTIER_NVCC_VERSION={}", nvcc_version(&nvcc));
    println!("cargo::rustc-env=KVTIER_NVCC_SOURCE={source}");
}

/// nvcc's version, `13.0.88` from the `Cuda compilation tools, release 13.0, V13.0.88` line of `nvcc --version`.
fn nvcc_version(nvcc: &Path) -> String {
    let out = Command::new(nvcc)
        .arg("--version")
        .output()
        .unwrap_or_else(|e| panic!("running {} --version: {e}", nvcc.display()));
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .filter(|l| l.contains("release"))
        .find_map(|l| l.split_whitespace().last())
        .map(|v| v.trim_start_matches('V').to_string())
        .unwrap_or_else(|| panic!("{} --version names no release:\n{text}", nvcc.display()))
}

/// nvcc, and where it was found: `NVCC`, `CUDA_HOME`, `nvidia-cuda-nvcc wheel` or `PATH`.
fn find_nvcc() -> Option<(PathBuf, &'static str)> {
    let exists = |p: PathBuf| p.is_file().then_some(p);
    if let Some(p) = env::var_os("NVCC").map(PathBuf::from).and_then(exists) {
        return Some((p, "NVCC"));
    }
    if let Some(p) = env::var_os("CUDA_HOME").map(|h| PathBuf::from(h).join("bin/nvcc")).and_then(exists) {
        return Some((p, "CUDA_HOME"));
    }
    // The nvidia-cuda-nvcc wheel of the build requirements. In pip's isolated build it is on the build
    // interpreter's import path (not in its purelib), so ask the interpreter where the `nvidia` namespace
    // package is rather than guessing a directory.
    let pythons = ["PYO3_PYTHON", "PYTHON_SYS_EXECUTABLE"]
        .iter()
        .filter_map(|v| env::var(v).ok())
        .chain(["python3".to_string(), "python".to_string()]);
    for py in pythons {
        for dir in nvidia_package_dirs(&py) {
            if let Some(p) = exists(dir.join("cu13/bin/nvcc")) {
                return Some((p, "nvidia-cuda-nvcc wheel"));
            }
        }
    }
    env::var_os("PATH")
        .and_then(|paths| env::split_paths(&paths).map(|d| d.join("nvcc")).find_map(exists))
        .map(|p| (p, "PATH"))
}

/// The directories of the `nvidia` namespace package as `python` imports it (none if it cannot).
fn nvidia_package_dirs(python: &str) -> Vec<PathBuf> {
    const SCRIPT: &str = "import nvidia; print(\"\\n\".join(nvidia.__path__))";
    match Command::new(python).args(["-c", SCRIPT]).output() {
        Ok(out) if out.status.success() => String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(PathBuf::from)
            .collect(),
        _ => Vec::new(),
    }
}
