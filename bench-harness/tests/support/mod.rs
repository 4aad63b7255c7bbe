//! Helpers shared by the harness's integration tests: run the
//! `shardline-bench` binary with a time bound.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The harness binary under test.
pub fn bench_binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_shardline-bench"))
}

/// The node binary next to the harness (same target directory and profile).
///
/// # Panics
/// When it has not been built; `scripts/test` builds every binary first.
pub fn node_binary() -> PathBuf {
    let path = bench_binary().with_file_name("shardline");
    assert!(
        path.is_file(),
        "{} is missing: build it first (`cargo build --release -p shardline`, or scripts/test)",
        path.display()
    );
    path
}

/// The OLTP trace shipped with the harness.
pub fn oltp_trace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("data/OLTP.lis.zst")
}

/// Runs the harness with `args`, killing it after `limit`.
///
/// # Panics
/// When it cannot be started or runs past `limit`.
pub fn run_bench(args: &[&str], limit: Duration) -> Output {
    let mut command = Command::new(bench_binary());
    command.env("SHARDLINE_BIN", node_binary_if_built());
    run_command(command, args, limit)
}

/// Runs `command` with `args`, killing it after `limit` (SIGTERM, then
/// SIGKILL 5 s later).
///
/// # Panics
/// When it cannot be started or runs past `limit`.
pub fn run_command(mut command: Command, args: &[&str], limit: Duration) -> Output {
    let mut child = command
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start shardline-bench");
    let started = Instant::now();
    // Drain the pipes in threads so a chatty child cannot block.
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let out_thread = std::thread::spawn(move || {
        let mut s = Vec::new();
        std::io::Read::read_to_end(&mut out, &mut s).ok();
        s
    });
    let err_thread = std::thread::spawn(move || {
        let mut s = Vec::new();
        std::io::Read::read_to_end(&mut err, &mut s).ok();
        s
    });
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if started.elapsed() > limit {
            // SIGTERM lets the harness stop its nodes, then SIGKILL.
            unsafe_sigterm(child.id());
            std::thread::sleep(Duration::from_secs(5));
            let _ = child.kill();
            let _ = child.wait();
            panic!("{command:?} {args:?} ran past {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Output {
        status,
        stdout: out_thread.join().unwrap(),
        stderr: err_thread.join().unwrap(),
    }
}

fn node_binary_if_built() -> PathBuf {
    bench_binary().with_file_name("shardline")
}

fn unsafe_sigterm(pid: u32) {
    let _ = Command::new("kill")
        .arg("-TERM")
        .arg(pid.to_string())
        .status();
}
