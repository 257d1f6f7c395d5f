//! Backend plugins through the C ABI: the CPU backend loaded from `libspark_backend_cpu.so` gives
//! bit-identical logits to the statically linked one; `include/spark.h` matches the Rust layout;
//! a plugin of another ABI version is refused naming both versions and the file; a panic inside
//! a plugin comes back as an error and the host carries on; missing and corrupt libraries give
//! clear errors; the C example and `spark-run --backend PATH` reproduce the golden greedy ids; and
//! `spark-run backends` lists what it finds and why the rest is unusable.
//!
//! The plugin libraries are cdylibs of workspace members, which `cargo test` does not build:
//! [`artifacts`] runs `cargo build --workspace` once, with the profile and target directory of
//! this test binary, and returns `target/<profile>/`.

mod common;

use std::mem::{offset_of, size_of};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, OnceLock};

use backend_cpu::CpuBackend;
use common::*;
use spark_core::plugin::abi::*;
use spark_core::plugin::loader::{load_plugin, plugin_file_name, Plugin};
use spark_core::plugin::OpenOptions;
use spark_core::{ErrorKind, Executor, LogitsMode, Model, ModelOptions, SeqStep};

/// `target/<profile>/` of this test binary, after building the workspace's libraries and
/// binaries there (the profile is the directory's name: `debug` is `dev`).
fn artifacts() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let exe = std::env::current_exe().expect("current_exe");
        // target/<profile>/deps/plugin-<hash>
        let profile_dir = exe.parent().and_then(Path::parent).expect("target/<profile>/deps").to_path_buf();
        let target_dir = profile_dir.parent().expect("target dir");
        let profile = profile_dir.file_name().and_then(|s| s.to_str()).expect("profile dir name");
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.current_dir(repo()).args(["build", "--workspace", "--target-dir"]).arg(target_dir);
        // Cargo describes this test's package in the environment (CARGO_PKG_NAME,
        // CARGO_MANIFEST_DIR, ...); some build scripts (ring's) rerun when those change, so
        // passing them on would rebuild those crates here and again in the next plain build.
        for (k, _) in std::env::vars_os() {
            let name = k.to_string_lossy();
            let set_by_cargo = ["CARGO_PKG_", "CARGO_MANIFEST_", "CARGO_CRATE_", "CARGO_BIN_", "CARGO_PRIMARY_PACKAGE"]
                .iter()
                .any(|p| name.starts_with(p))
                || name == "CARGO_TARGET_TMPDIR"
                || name == "OUT_DIR";
            if set_by_cargo {
                cmd.env_remove(&k);
            }
        }
        match profile {
            "debug" => {}
            "release" => {
                cmd.arg("--release");
            }
            other => {
                cmd.args(["--profile", other]);
            }
        }
        let out = cmd.output().expect("running cargo build");
        assert!(out.status.success(), "cargo build --workspace failed:\n{}", String::from_utf8_lossy(&out.stderr));
        profile_dir
    })
}

fn lib(file: &str) -> PathBuf {
    let p = artifacts().join(file);
    assert!(p.is_file(), "{} was not built", p.display());
    p
}

fn cpu_plugin() -> Arc<Plugin> {
    load_plugin(&lib(&plugin_file_name("cpu"))).unwrap()
}

fn test_plugin(name: &str) -> PathBuf {
    lib(&format!("{}spark_testplugin_{name}{}", std::env::consts::DLL_PREFIX, std::env::consts::DLL_SUFFIX))
}

fn golden_ckpt() -> PathBuf {
    repo().join("testdata/golden/m8/ckpt_f32")
}

fn join(ids: &[u32]) -> String {
    ids.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(",")
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Prefill (all rows), then a fork, then cached decode steps on both sequences in one batch:
/// every logit produced, in order.
fn exercise(e: &mut dyn Executor, prompt: &[u32], feed: &[u32]) -> Vec<f32> {
    let v = e.info().vocab;
    let mut all = vec![0.0; prompt.len() * v];
    e.forward(&[SeqStep { seq_id: 1, tokens: prompt, start_pos: 0, logits: LogitsMode::All }], &mut all).unwrap();
    e.fork(1, 2).unwrap();
    assert_eq!(e.seq_len(2), Some(prompt.len()));
    let mut rows = vec![0.0; 2 * v];
    for (t, &id) in feed.iter().enumerate() {
        let pos = (prompt.len() + t) as u32;
        let other = [feed[feed.len() - 1 - t]];
        let batch = [
            SeqStep { seq_id: 1, tokens: &[id], start_pos: pos, logits: LogitsMode::Last },
            SeqStep { seq_id: 2, tokens: &other, start_pos: pos, logits: LogitsMode::Last },
        ];
        e.forward(&batch, &mut rows).unwrap();
        all.extend_from_slice(&rows);
    }
    assert!(e.kv_bytes() > 0);
    all.push(e.kv_bytes() as f32);
    e.release(1);
    e.release(2);
    assert_eq!((e.seq_len(1), e.kv_bytes()), (None, 0));
    all
}

#[test]
fn cpu_plugin_gives_bit_identical_logits_to_the_static_backend() {
    let gold = load_golden(&repo().join("testdata/golden/m8/golden.safetensors"));
    let mut stat = Model::load(CpuBackend::new(Some(2)).unwrap(), &golden_ckpt(), &ModelOptions::default()).unwrap();
    let plugin = cpu_plugin();
    assert_eq!((plugin.name(), plugin.abi_version()), ("cpu", ABI_VERSION));
    let mut dynamic = plugin.open(&golden_ckpt(), &OpenOptions { threads: Some(2), ..Default::default() }).unwrap();
    let (si, di) = (stat.info(), dynamic.info());
    assert_eq!((si.backend, si.vocab, si.ctx, si.dtype), (di.backend, di.vocab, di.ctx, di.dtype));
    for p in ["p0", "p1", "p2"] {
        let ids = &gold[&format!("{p}.input_ids")].ids;
        let feed = &gold[&format!("{p}.greedy_ids")].ids[..6];
        let a = exercise(&mut stat, ids, feed);
        let b = exercise(&mut dynamic, ids, feed);
        assert_eq!(a.len(), b.len());
        assert!(bits(&a) == bits(&b), "{p}: plugin logits differ from static (max |diff| {})", max_abs_diff(&a, &b));
    }
    // Errors come back through the ABI with their kind and message.
    let mut out = vec![0.0; di.vocab];
    let e = dynamic
        .forward(&[SeqStep { seq_id: 9, tokens: &[99_999], start_pos: 0, logits: LogitsMode::Last }], &mut out)
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidInput);
    assert!(e.message.contains("token id 99999 is outside the vocabulary"), "{e}");
    let e = dynamic.fork(77, 78).unwrap_err();
    assert!(e.message.contains("no sequence 77"), "{e}");
    let e = dynamic.forward(&[SeqStep { seq_id: 9, tokens: &[1], start_pos: 0, logits: LogitsMode::All }], &mut []);
    assert!(e.unwrap_err().message.contains("the batch needs"));
}

#[test]
fn plugin_open_errors_name_the_checkpoint() {
    let e = cpu_plugin().open(Path::new("/no/such/checkpoint"), &OpenOptions::default()).err().unwrap();
    assert!(e.message.contains("/no/such/checkpoint"), "{e}");
    let e = cpu_plugin().open(&golden_ckpt(), &OpenOptions { device: 4, ..Default::default() }).err().unwrap();
    assert!(e.message.contains("device 4"), "{e}");
}

#[test]
fn a_plugin_of_another_abi_version_is_refused() {
    let path = test_plugin("bad_abi");
    let e = load_plugin(&path).unwrap_err();
    assert_eq!(e.kind, ErrorKind::Unsupported);
    assert!(e.message.contains("ABI version 999") && e.message.contains(&format!("ABI version {ABI_VERSION}")), "{e}");
    assert!(e.message.contains(&path.display().to_string()), "{e}");
}

#[test]
fn a_panic_inside_a_plugin_is_an_error_and_the_host_carries_on() {
    let path = test_plugin("panicky");
    let p = load_plugin(&path).unwrap();
    assert_eq!(p.name(), "panicky");
    let mut e = p.open(Path::new("unused"), &OpenOptions::default()).unwrap();
    let mut out = vec![0.0; 4];
    let err = e.forward(&[SeqStep { seq_id: 1, tokens: &[0], start_pos: 0, logits: LogitsMode::Last }], &mut out);
    let err = err.unwrap_err();
    assert_eq!(err.kind, ErrorKind::Internal);
    assert!(err.message.contains("forward panicked: deliberate panic in forward (1 sequences)"), "{err}");
    assert!(err.message.contains(&path.canonicalize().unwrap().display().to_string()), "{err}");
    // The handle is poisoned: refused, with the reason, until closed.
    let again = e.fork(1, 2).unwrap_err();
    assert!(again.message.contains("unusable after an earlier panic"), "{again}");
    drop(e);
    // A fresh handle works, and ordinary errors are not panics.
    let mut e = p.open(Path::new("unused"), &OpenOptions::default()).unwrap();
    let err = e.fork(5, 6).unwrap_err();
    assert_eq!((err.kind, err.message.as_str()), (ErrorKind::InvalidInput, "fork: no sequence 5"));
    // And the host still runs models.
    let mut m = cpu_plugin().open(&golden_ckpt(), &OpenOptions { threads: Some(1), ..Default::default() }).unwrap();
    let mut row = vec![0.0; m.info().vocab];
    m.forward(&[SeqStep { seq_id: 1, tokens: &[0, 5], start_pos: 0, logits: LogitsMode::Last }], &mut row).unwrap();
    assert!(row.iter().all(|x| x.is_finite()));
}

/// Compile `src` with the system C compiler into `out` (`extra`: more arguments).
fn cc(src: &Path, out: &Path, extra: &[&str]) {
    let include = repo().join("include");
    let st = Command::new("cc")
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-I"])
        .arg(&include)
        .arg(src)
        .arg("-o")
        .arg(out)
        .args(extra)
        .output()
        .expect("running cc (the system C compiler)");
    assert!(st.status.success(), "cc {}:\n{}", src.display(), String::from_utf8_lossy(&st.stderr));
}

#[test]
fn missing_and_corrupt_libraries_give_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("libspark_backend_gone.so");
    let e = load_plugin(&missing).unwrap_err();
    assert!(e.message.contains(&missing.display().to_string()) && e.message.contains("No such file"), "{e}");

    let text = dir.path().join("libspark_backend_text.so");
    std::fs::write(&text, "not a library\n").unwrap();
    let e = load_plugin(&text).unwrap_err();
    assert!(e.message.starts_with(&format!("cannot load backend plugin {}", text.display())), "{e}");

    // A real shared library without the entry symbol.
    let src = dir.path().join("nosym.c");
    std::fs::write(&src, "int not_spark(void) { return 1; }\n").unwrap();
    let so = dir.path().join("libnosym.so");
    cc(&src, &so, &["-shared", "-fPIC"]);
    let e = load_plugin(&so).unwrap_err();
    assert!(e.message.contains("is not a spark backend plugin: no symbol spark_backend_v1"), "{e}");
    assert!(e.message.contains(&so.display().to_string()), "{e}");
}

#[test]
fn spark_h_matches_the_rust_layout() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("layout.c");
    let fields: &[(&str, &[&str])] = &[
        (
            "spark_device_info",
            &["index", "usable", "score", "reserved", "memory_total", "memory_free", "name", "capabilities", "note"],
        ),
        ("spark_open_options", &["threads", "ctx_size", "dtype", "device"]),
        ("spark_exec_info", &["vocab", "ctx", "dtype", "reserved"]),
        ("spark_seq_step", &["seq_id", "tokens", "n_tokens", "start_pos", "logits"]),
        (
            "spark_backend_v1",
            &[
                "abi_version",
                "table_size",
                "name",
                "probe",
                "open",
                "info",
                "forward",
                "release",
                "fork",
                "seq_len",
                "kv_bytes",
                "close",
                "last_error",
            ],
        ),
    ];
    let mut c = String::from("#include <stdio.h>\n#include <stddef.h>\n#include \"spark.h\"\nint main(void) {\n");
    for (ty, fs) in fields {
        c += &format!("  printf(\"{ty} %zu %zu\\n\", sizeof({ty}), _Alignof({ty}));\n");
        for f in *fs {
            c += &format!("  printf(\"{ty}.{f} %zu\\n\", offsetof({ty}, {f}));\n");
        }
    }
    let consts = [
        "SPARK_ABI_VERSION",
        "SPARK_OK",
        "SPARK_ERR_INVALID_INPUT",
        "SPARK_ERR_BAD_MODEL",
        "SPARK_ERR_OUT_OF_MEMORY",
        "SPARK_ERR_UNSUPPORTED",
        "SPARK_ERR_IO",
        "SPARK_ERR_BACKEND",
        "SPARK_ERR_INTERNAL",
        "SPARK_ERR_PANIC",
        "SPARK_DTYPE_DEFAULT",
        "SPARK_DTYPE_F32",
        "SPARK_DTYPE_BF16",
        "SPARK_DTYPE_F16",
        "SPARK_LOGITS_NONE",
        "SPARK_LOGITS_LAST",
        "SPARK_LOGITS_ALL",
        "SPARK_DEVICE_NAME_LEN",
        "SPARK_DEVICE_CAPS_LEN",
        "SPARK_DEVICE_NOTE_LEN",
    ];
    for k in consts {
        c += &format!("  printf(\"{k} %lld\\n\", (long long)({k}));\n");
    }
    c += "  printf(\"entry %s\\n\", SPARK_ENTRY_SYMBOL);\n";
    c += "  return 0;\n}\n";
    std::fs::write(&src, c).unwrap();
    let exe = dir.path().join("layout");
    cc(&src, &exe, &[]);
    let out = Command::new(&exe).output().unwrap();
    let text = String::from_utf8(out.stdout).unwrap();

    macro_rules! layout {
        ($c:literal, $t:ty, [$($f:ident),*]) => {{
            let mut v = vec![format!("{} {} {}", $c, size_of::<$t>(), std::mem::align_of::<$t>())];
            $(v.push(format!("{}.{} {}", $c, stringify!($f), offset_of!($t, $f)));)*
            v
        }};
    }
    let mut want = Vec::new();
    want.extend(layout!(
        "spark_device_info",
        SparkDeviceInfo,
        [index, usable, score, reserved, memory_total, memory_free, name, capabilities, note]
    ));
    want.extend(layout!("spark_open_options", SparkOpenOptions, [threads, ctx_size, dtype, device]));
    want.extend(layout!("spark_exec_info", SparkExecInfo, [vocab, ctx, dtype, reserved]));
    want.extend(layout!("spark_seq_step", SparkSeqStep, [seq_id, tokens, n_tokens, start_pos, logits]));
    want.extend(layout!(
        "spark_backend_v1",
        SparkBackendV1,
        [
            abi_version,
            table_size,
            name,
            probe,
            open,
            info,
            forward,
            release,
            fork,
            seq_len,
            kv_bytes,
            close,
            last_error
        ]
    ));
    let values = [
        ABI_VERSION as i64,
        SPARK_OK as i64,
        SPARK_ERR_INVALID_INPUT as i64,
        SPARK_ERR_BAD_MODEL as i64,
        SPARK_ERR_OUT_OF_MEMORY as i64,
        SPARK_ERR_UNSUPPORTED as i64,
        SPARK_ERR_IO as i64,
        SPARK_ERR_BACKEND as i64,
        SPARK_ERR_INTERNAL as i64,
        SPARK_ERR_PANIC as i64,
        SPARK_DTYPE_DEFAULT as i64,
        SPARK_DTYPE_F32 as i64,
        SPARK_DTYPE_BF16 as i64,
        SPARK_DTYPE_F16 as i64,
        SPARK_LOGITS_NONE as i64,
        SPARK_LOGITS_LAST as i64,
        SPARK_LOGITS_ALL as i64,
        DEVICE_NAME_LEN as i64,
        DEVICE_CAPS_LEN as i64,
        DEVICE_NOTE_LEN as i64,
    ];
    want.extend(consts.iter().zip(values).map(|(k, v)| format!("{k} {v}")));
    want.push(format!("entry {}", std::str::from_utf8(&ENTRY_SYMBOL[..ENTRY_SYMBOL.len() - 1]).unwrap()));
    assert_eq!(text.lines().collect::<Vec<_>>(), want);
}

#[test]
fn the_c_example_reproduces_the_golden_greedy_ids() {
    let gold = load_golden(&repo().join("testdata/golden/m8/golden.safetensors"));
    let dir = tempfile::tempdir().unwrap();
    let exe = dir.path().join("greedy");
    cc(&repo().join("examples/c/greedy.c"), &exe, &["-ldl"]);
    let so = lib(&plugin_file_name("cpu"));
    for p in ["p0", "p1"] {
        let ids = &gold[&format!("{p}.input_ids")].ids;
        let want = &gold[&format!("{p}.greedy_ids")].ids;
        let out =
            Command::new(&exe).arg(&so).arg(golden_ckpt()).arg(join(ids)).arg(want.len().to_string()).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(String::from_utf8(out.stdout).unwrap().trim(), join(want), "{p}");
    }
    // Its errors carry the backend's message.
    let out = Command::new(&exe).arg(&so).arg("/no/such/ckpt").arg("0").output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("open failed") && err.contains("/no/such/ckpt"), "{err}");
    let out = Command::new(&exe).arg(test_plugin("bad_abi")).arg(golden_ckpt()).arg("0").output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("ABI version 999, this program speaks version 1"), "{err}");
}

fn spark_run() -> Command {
    let mut c = Command::new(artifacts().join(format!("spark-run{}", std::env::consts::EXE_SUFFIX)));
    c.env_remove("SPARK_PLUGIN_PATH");
    c
}

#[test]
fn spark_run_with_the_cpu_plugin_reproduces_the_golden_greedy_ids() {
    let gold = load_golden(&repo().join("testdata/golden/m8/golden.safetensors"));
    let ids = join(&gold["p0.input_ids"].ids);
    let want = join(&gold["p0.greedy_ids"].ids);
    let so = lib(&plugin_file_name("cpu"));
    let ckpt = golden_ckpt();
    let gen = ["generate", "--model", ckpt.to_str().unwrap(), "--ids", &ids, "-n", "24"];
    let greedy = ["--temperature", "0", "--print-ids"];
    // --backend before and after the subcommand.
    for before in [true, false] {
        let mut c = spark_run();
        if before {
            c.arg("--backend").arg(&so).args(gen).args(greedy);
        } else {
            c.args(gen).args(greedy).arg("--backend").arg(&so);
        }
        let out = c.output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(String::from_utf8(out.stdout).unwrap().trim(), want);
    }
    // By name: cpu is linked in; qnn is nowhere (no backend-qnn yet); a plugin found by name on
    // --plugin-dir (a name no linked-in backend has, so the plugin is not shadowed).
    let out = spark_run().args(gen).args(greedy).args(["--backend", "cpu"]).output().unwrap();
    assert_eq!(String::from_utf8(out.stdout).unwrap().trim(), want);
    let out = spark_run().args(["--backend", "qnn"]).args(gen).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains(&format!("qnn: no plugin {} found in [", plugin_file_name("qnn"))), "{err}");
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(test_plugin("bad_abi"), dir.path().join(plugin_file_name("badabi"))).unwrap();
    let out = spark_run().args(["--backend", "badabi", "--plugin-dir"]).arg(dir.path()).args(gen).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("speaks ABI version 999"), "{err}");
    for bad in ["/no/such/libspark_backend_x.so", "Not A Name"] {
        let out = spark_run().args(["--backend", bad]).args(gen).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(bad) && !err.contains("panicked"), "{err}");
    }
}

#[test]
fn spark_run_backends_lists_what_it_finds_and_why_the_rest_is_unusable() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(test_plugin("bad_abi"), dir.path().join(plugin_file_name("badabi"))).unwrap();
    std::fs::copy(test_plugin("panicky"), dir.path().join(plugin_file_name("panicky"))).unwrap();
    std::fs::write(dir.path().join(plugin_file_name("junk")), "text, not a library").unwrap();
    let out = spark_run().arg("backends").arg("--plugin-dir").arg(dir.path()).output().unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let d = dir.path().canonicalize().unwrap();
    for want in [
        "cpu (static, ABI 1)".to_string(),
        format!("cpu ({}, ABI 1)", lib(&plugin_file_name("cpu")).canonicalize().unwrap().display()),
        "shadowed by the static cpu backend".to_string(),
        format!("panicky ({}, ABI 1)", d.join(plugin_file_name("panicky")).display()),
        "device 0: nothing [panics] score 1".to_string(),
        format!("qnn: no plugin {} found in [{}", plugin_file_name("qnn"), dir.path().display()),
        "speaks ABI version 999, but this spark speaks ABI version 1".to_string(),
        format!("junk ({}): unusable: cannot load backend plugin", dir.path().join(plugin_file_name("junk")).display()),
        "auto: cpu (static), device 0".to_string(),
    ] {
        assert!(text.contains(&want), "missing '{want}' in:\n{text}");
    }
    // JSON: one object per line.
    let out = spark_run().args(["backends", "--json"]).output().unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    for line in text.lines() {
        serde_json::from_str::<serde_json::Value>(line).unwrap();
    }
    assert!(text.contains("\"backend\":\"qnn\""), "{text}");
}

/// The cuda and wgpu plugin files export named entry points (`spark_backend_v1_cuda`, ...) so
/// that all three backends also link into one spark-run; the loader finds them by file name,
/// and their probes answer (usable or with a reason) without panicking on any machine.
#[test]
fn named_entry_points_load_and_probe() {
    for name in ["cuda", "wgpu"] {
        let p = load_plugin(&lib(&plugin_file_name(name))).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!((p.name(), p.abi_version()), (name, ABI_VERSION));
        let devices = p.probe().unwrap();
        assert!(!devices.is_empty(), "{name}: a probe reports at least one entry (a device, or why none)");
        for d in devices.iter().filter(|d| !d.usable) {
            assert!(!d.note.is_empty(), "{name}: an unusable device must say why: {d:?}");
        }
    }
}
