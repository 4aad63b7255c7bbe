//! Command-line behaviour that needs no running node.

mod support;

use std::time::Duration;

use support::run_bench;

#[test]
fn a_malformed_trace_line_is_an_error_naming_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("broken.lis");
    std::fs::write(&trace, "1 1 0 0\n2 1 0 1\n3 one 0 2\n").unwrap();
    // No node listens on port 1: the trace is read before any connection is made.
    let out = run_bench(
        &[
            "run",
            "--connect",
            "127.0.0.1:1",
            "--trace",
            trace.to_str().unwrap(),
            "--no-progress",
        ],
        Duration::from_secs(60),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("broken.lis:3"), "{stderr}");
}

#[test]
fn verify_without_adds_is_refused() {
    let out = run_bench(
        &[
            "run",
            "--connect",
            "127.0.0.1:1",
            "--op",
            "echo",
            "--verify",
        ],
        Duration::from_secs(60),
    );
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--verify needs counter adds"));
}

#[test]
fn help_lists_the_subcommands() {
    let out = run_bench(&["--help"], Duration::from_secs(60));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(text.contains("run") && text.contains("demo"), "{text}");
}
