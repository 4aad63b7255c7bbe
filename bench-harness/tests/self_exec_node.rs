//! The bench starts its nodes by running itself as `shardline-bench node`
//! (the `shardline` command line), so `cargo run -p shardline-bench` needs
//! no second build. Run from a copy of the bench binary in a directory with
//! no `shardline` next to it and with `SHARDLINE_BIN` unset, a one-node
//! cluster forms, serves counter adds that verify, and stops.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use support::{bench_binary, run_command};

/// Held by each test of this file for its whole run: a test that copies
/// the binary holds the copy open for writing while the other may fork to
/// spawn a child, which inherits that descriptor until it execs; the copy's
/// own exec then fails with "Text file busy" (ETXTBSY).
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner())
}

/// A copy of the bench binary alone in `dir`.
fn lone_bench(dir: &Path) -> PathBuf {
    let copy = dir.join("bench-copy");
    std::fs::copy(bench_binary(), &copy).expect("copy the bench binary");
    assert!(!dir.join("shardline").exists());
    copy
}

fn command(program: &Path) -> Command {
    let mut c = Command::new(program);
    // No backtraces: with them the old `shardline` printed anyhow's.
    c.env_remove("SHARDLINE_BIN")
        .env_remove("CARGO")
        .env_remove("RUST_BACKTRACE")
        .env_remove("RUST_LIB_BACKTRACE");
    c
}

#[test]
fn a_local_cluster_runs_on_the_bench_binary_alone() {
    let _one = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let bench = lone_bench(dir.path());
    let out = run_command(
        command(&bench),
        &[
            "run",
            "--spawn",
            "1",
            "--op",
            "counter-add",
            "--verify",
            "--entities",
            "50",
            "--max-requests",
            "300",
            "--no-progress",
        ],
        Duration::from_secs(60),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    // The nodes were the bench binary itself, and nothing was built.
    assert!(
        stderr.contains(&format!("({} node)", bench.display())),
        "{stderr}"
    );
    assert!(!stderr.contains("building"), "{stderr}");
    assert!(stdout.contains(", 0 lost, 0 duplicated"), "{stdout}");
    assert!(!dir.path().join("shardline").exists());
}

/// `shardline-bench node` answers bad input as `shardline node` does: the
/// same message on stderr and the same exit code (1 for a config that
/// cannot be read, 2 for a usage error).
#[test]
fn the_node_subcommand_fails_as_the_shardline_binary_does() {
    let _one = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let bench = lone_bench(dir.path());
    let missing = dir.path().join("missing.toml");
    let cases: [Vec<&str>; 2] = [
        vec!["node", "--config", missing.to_str().unwrap()],
        vec!["node", "--no-such-flag"],
    ];
    let shardline = bench_binary().with_file_name("shardline");
    for (args, code) in cases.iter().zip([1, 2]) {
        let out = run_command(command(&bench), args, Duration::from_secs(20));
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(code), "{args:?}: {stderr}");
        assert!(stderr.contains("rror"), "{stderr}");
        // The shardline binary, when built (scripts/test builds every binary).
        if shardline.is_file() {
            let reference = run_command(command(&shardline), args, Duration::from_secs(20));
            assert_eq!(reference.status.code(), Some(code));
            assert_eq!(String::from_utf8_lossy(&reference.stderr), stderr);
        }
    }
}
