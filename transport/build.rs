//! Build script: generates the libfabric bindings of the `fabric` backend.
//!
//! Does nothing unless the `fabric` cargo feature is on. With it, bindgen reads the
//! system libfabric headers (`<rdma/fabric.h>` and friends, Debian libfabric-dev 1.17).
//! The crate does not link `libfabric`: the few functions the library exports are
//! loaded at run time (`src/fabric/sys.rs`), because libfabric's constructors cost
//! every process that links it about 200 ms at start, fabric or not, and a missing
//! library must be an error of the fabric transport rather than of the loader.
//!
//! Most of libfabric's API (`fi_domain`, `fi_endpoint`, `fi_tsend`, `fi_cq_read`,
//! `fi_mr_reg`, `fi_close`, ...) is `static inline` in the headers, calling through the
//! providers' operation tables, so there is no symbol to link against. We let bindgen's
//! `wrap_static_fns` write a C file with one exported wrapper per inline function and
//! compile it with `cc`, rather than keep a hand-written C shim: the wrappers are
//! generated from the installed headers, so their signatures cannot drift from the
//! libfabric we build against, and there is no C of our own to maintain.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=CARGO_FEATURE_FABRIC");
    // The bindgen and cc build-dependencies exist only with the feature.
    #[cfg(feature = "fabric")]
    if std::env::var_os("CARGO_FEATURE_FABRIC").is_some() {
        fabric::generate();
    }
}

#[cfg(feature = "fabric")]
mod fabric {
    use std::path::PathBuf;

    /// The headers the backend uses; `fabric.h` first, as the others expect.
    const HEADERS: &[&str] = &[
        "rdma/fabric.h",
        "rdma/fi_domain.h",
        "rdma/fi_endpoint.h",
        "rdma/fi_tagged.h",
        "rdma/fi_rma.h",
        "rdma/fi_cm.h",
        "rdma/fi_errno.h",
    ];

    /// The exported libfabric functions the backend calls; `sys.rs` loads them.
    const EXPORTED: &str = "fi_(getinfo|freeinfo|dupinfo|fabric|strerror)";

    pub(super) fn generate() {
        let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR for build scripts"));
        let wrapper = out.join("fabric_all.h");
        let includes: String = HEADERS.iter().map(|h| format!("#include <{h}>\n")).collect();
        std::fs::write(&wrapper, includes).expect("writing the header wrapper into OUT_DIR");
        let statics = out.join("fabric_static_fns");
        let bindings = bindgen::Builder::default()
            .header(wrapper.to_string_lossy())
            .allowlist_function("fi_.*")
            .allowlist_type("fi_.*")
            .allowlist_var("FI_.*")
            // Exported by libfabric, so loaded at run time by sys.rs, not linked.
            .blocklist_function(EXPORTED)
            // An inline function calling fi_dupinfo; sys.rs defines it over the loaded one.
            .blocklist_function("fi_allocinfo")
            .wrap_static_fns(true)
            .wrap_static_fns_path(&statics)
            .derive_default(true)
            .layout_tests(false)
            .generate_comments(false)
            .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()))
            .generate()
            .unwrap_or_else(|e| {
                panic!("bindgen could not read the libfabric headers (install libfabric-dev and libclang-dev): {e}")
            });
        bindings.write_to_file(out.join("fabric_bindings.rs")).expect("writing the bindings into OUT_DIR");
        cc::Build::new()
            .file(statics.with_extension("c"))
            .include(&out)
            .flag_if_supported("-Wno-unused-parameter")
            .flag_if_supported("-Wno-deprecated-declarations")
            .compile("ductile_fabric_static_fns");
    }
}
