//! Compiles the CUDA copy kernel in `cuda/` when nvcc can be found, and links the CUDA runtime statically.
//!
//! nvcc is looked for in this order: `NVCC`, `$CUDA_HOME/bin/nvcc`, the `nvidia-cuda-nvcc` wheel of the build
//! Python (`nvidia/cu13/bin/nvcc`), then `PATH`. `KVTIER_NO_CUDA=1` builds without CUDA. Without nvcc the crate
//! still builds; the `kvtier_cuda` cfg is then off and the module reports CUDA unavailable at run time.
use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

const CUDA_SOURCES: &[&str] = &["cuda/copy.cu"];

fn main() {
    println!("cargo::rustc-check-cfg=cfg(kvtier_cuda)");
    for var in ["NVCC", "CUDA_HOME", "KVTIER_NO_CUDA", "PYO3_PYTHON", "PYTHON_SYS_EXECUTABLE", "PATH"] {
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
    let Some(nvcc) = find_nvcc() else {
        println!("cargo::warning=nvcc not found: building without the CUDA copy kernel");
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
    println!("cargo::rustc-env=KVTIER_NVCC={}", nvcc.display());
}

fn find_nvcc() -> Option<PathBuf> {
    let exists = |p: PathBuf| p.is_file().then_some(p);
    if let Some(p) = env::var_os("NVCC").map(PathBuf::from).and_then(exists) {
        return Some(p);
    }
    if let Some(p) = env::var_os("CUDA_HOME").map(|h| PathBuf::from(h).join("bin/nvcc")).and_then(exists) {
        return Some(p);
    }
    let pythons = ["PYO3_PYTHON", "PYTHON_SYS_EXECUTABLE"]
        .iter()
        .filter_map(|v| env::var(v).ok())
        .chain(["python3".to_string(), "python".to_string()]);
    for py in pythons {
        let out = Command::new(&py)
            .args(["-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
            .output();
        if let Ok(out) = out {
            let site = String::from_utf8_lossy(&out.stdout).trim().to_string();
            if let Some(p) = exists(PathBuf::from(site).join("nvidia/cu13/bin/nvcc")) {
                return Some(p);
            }
        }
    }
    env::var_os("PATH").and_then(|paths| env::split_paths(&paths).map(|d| d.join("nvcc")).find_map(exists))
}
