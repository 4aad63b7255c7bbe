//! Durable counters across a whole-cluster restart of a single `shardline
//! node`: shards allocated in one order before a SIGTERM, in the reverse
//! order after the restart on the same `data_dir`. Every shard's new
//! allocation generation (its journal writer epoch) must stay above the
//! epochs its journal already holds, or the appends are fenced and the
//! counters answer `EntityFailed`.

#[path = "node_cases/support.rs"]
mod support;

use std::path::Path;
use std::time::{Duration, Instant};

use shardline::client::{Client, Status};
use support::{config_text, shardline_bin, spawn_node, NodeProc, Ports};

/// Cluster port of the node; its client port is `BASE_PORT + 50`.
const BASE_PORT: u16 = 24_800;
/// Counters asked before and after the restart.
const COUNTERS: usize = 200;
/// Shards of the `counter` type.
const SHARDS: u32 = 20;

/// Starts `shardline node` with `cfg`, its stderr appended to `log`.
fn spawn(cfg: &Path, log: &Path) -> NodeProc {
    spawn_node(&shardline_bin(), cfg, log, "warn")
}

/// Time left before `deadline`, failing the test when none is.
fn left(deadline: Instant, what: &str) -> Duration {
    let d = deadline.saturating_duration_since(Instant::now());
    assert!(!d.is_zero(), "out of time before {what}");
    d
}

fn log_tail(log: &Path) -> String {
    let s = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}

/// Sends `payload` to each counter in `order`, one at a time, and asserts
/// every reply is `Ok` with `want`.
fn ask_each(
    client: &mut Client,
    ids: &[String],
    payload: &str,
    want: &str,
    deadline: Instant,
    log: &Path,
) {
    for id in ids {
        let t = left(deadline, payload).min(Duration::from_secs(10));
        let r = client
            .ask("counter", id, payload.as_bytes(), t)
            .unwrap_or_else(|e| panic!("{payload} {id}: {e}; log:\n{}", log_tail(log)));
        assert_eq!(
            (r.status, String::from_utf8_lossy(&r.payload).as_ref()),
            (Status::Ok, want),
            "{payload} {id}; log:\n{}",
            log_tail(log)
        );
    }
}

#[test]
fn counters_keep_answering_after_a_restart_that_allocates_shards_in_another_order() {
    let _bin = shardline_bin();
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_secs(60);
    let dir = tempfile::tempdir().expect("tempdir");
    let ports = Ports { base: BASE_PORT };
    let text = config_text(ports, 0, 1, 1, dir.path(), "")
        .replace(
            "number_of_shards = 60",
            &format!("number_of_shards = {SHARDS}"),
        )
        .replace("durability = \"none\"", "durability = \"always\"");
    assert!(
        text.contains(&format!("number_of_shards = {SHARDS}")) && text.contains("\"always\""),
        "config template changed:\n{text}"
    );
    let cfg = dir.path().join("node-0.toml");
    std::fs::write(&cfg, text).expect("write config");
    let log = dir.path().join("node-0.log");
    let ascending: Vec<String> = (0..COUNTERS).map(|i| format!("c-{i:03}")).collect();
    let descending: Vec<String> = ascending.iter().rev().cloned().collect();

    let mut node = spawn(&cfg, &log);
    node.ready
        .recv_timeout(left(deadline, "first start"))
        .unwrap_or_else(|_| panic!("node not ready; log:\n{}", log_tail(&log)));
    let mut c = Client::connect(ports.client(0)).expect("connect");
    ask_each(&mut c, &ascending, "add 1", "1", deadline, &log);
    drop(c);

    node.signal(libc::SIGTERM);
    let st = node
        .wait_exit(left(deadline, "exit after SIGTERM"))
        .unwrap_or_else(|| panic!("node did not exit after SIGTERM; log:\n{}", log_tail(&log)));
    assert!(
        st.success(),
        "exit after SIGTERM: {st}; log:\n{}",
        log_tail(&log)
    );
    drop(node);

    let node = spawn(&cfg, &log);
    node.ready
        .recv_timeout(left(deadline, "restart"))
        .unwrap_or_else(|_| panic!("node not ready after restart; log:\n{}", log_tail(&log)));
    let mut c = Client::connect(ports.client(0)).expect("connect after restart");
    ask_each(&mut c, &descending, "add 1", "2", deadline, &log);
    ask_each(&mut c, &ascending, "get", "2", deadline, &log);
    println!(
        "{COUNTERS} counters on {SHARDS} shards kept their values across a restart in {:?}",
        t0.elapsed()
    );
    drop(node);
}
