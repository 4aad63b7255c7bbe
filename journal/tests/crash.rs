//! Crash test: a child process appends under `Always` and prints every LSN
//! once it is durable; the parent kills it with SIGKILL at random moments
//! and checks, after reopening, that every printed LSN is present with its
//! bytes and that appends continue at the right sequence numbers.
//!
//! The child is this same test binary, started with `CRASH_CHILD_DIR` set
//! and filtered to the `crash_child` test.

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{opts, payload, pid};
use rand::{Rng, SeedableRng};
use shardline_journal::{AppendError, Durability, Journal, Lsn, SequenceNr, WriterEpoch};

const SEGMENT_BYTES: u64 = 64 * 1024;
const IDS: [&str; 3] = ["crash-a", "crash-b", "crash-c"];

/// The child's body; a no-op unless started by the parent.
#[test]
fn crash_child() {
    let Ok(dir) = std::env::var("CRASH_CHILD_DIR") else {
        return;
    };
    let epoch: u64 = std::env::var("CRASH_CHILD_EPOCH").unwrap().parse().unwrap();
    let (mut j, _) = Journal::open(&dir, opts(SEGMENT_BYTES, Durability::Always, epoch)).unwrap();
    let w = j.watcher();
    let mut out = std::io::stdout().lock();
    let mut pending: Vec<(Lsn, usize, u64)> = Vec::new();
    let mut seqs: Vec<u64> = IDS
        .iter()
        .map(|p| j.highest_sequence_nr(&pid(p)).0)
        .collect();
    writeln!(out, "READY").unwrap();
    out.flush().unwrap();
    let mut i = 0usize;
    loop {
        let k = i % IDS.len();
        i += 1;
        seqs[k] += 1;
        let lsn = j
            .append(
                &pid(IDS[k]),
                SequenceNr(seqs[k]),
                WriterEpoch(epoch),
                &payload(IDS[k], seqs[k]),
            )
            .unwrap();
        pending.push((lsn, k, seqs[k]));
        // Keep a bounded number in flight; report what became durable.
        if pending.len() >= 32 {
            w.wait_durable(pending[0].0).unwrap();
        }
        let durable = w.durable_lsn();
        let n = pending.partition_point(|p| p.0 <= durable);
        for (lsn, k, seq) in pending.drain(..n) {
            writeln!(out, "D {} {} {}", lsn.0, IDS[k], seq).unwrap();
        }
        out.flush().unwrap();
    }
}

#[test]
fn sigkill_at_random_moments_loses_no_acknowledged_record() {
    let dir = tempfile::tempdir().unwrap();
    let exe = std::env::current_exe().unwrap();
    let seed: u64 = rand::random();
    println!("crash test seed {seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut acked: HashMap<(String, u64), u64> = HashMap::new();
    let mut total_acked = 0usize;
    for round in 1..=20u64 {
        let mut child = Command::new(&exe)
            .args(["--exact", "crash_child", "--nocapture", "--test-threads=1"])
            .env("CRASH_CHILD_DIR", dir.path())
            .env("CRASH_CHILD_EPOCH", round.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                match line {
                    Ok(l) => {
                        if tx.send(l).is_err() {
                            break;
                        }
                    }
                    Err(_) => break,
                }
            }
        });
        // Wait until the child has opened the journal (recovery included),
        // let it append for a random while, then SIGKILL it.
        let mut lines = Vec::new();
        loop {
            match rx.recv_timeout(Duration::from_secs(60)) {
                // libtest may print "test crash_child ... " on the same line.
                Ok(l) if l.ends_with("READY") => break,
                Ok(l) => lines.push(l),
                Err(e) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    panic!("round {round}: child never got ready: {e} (seed {seed})");
                }
            }
        }
        std::thread::sleep(Duration::from_millis(rng.gen_range(5..120)));
        child.kill().unwrap();
        child.wait().unwrap();
        reader.join().unwrap();
        lines.extend(rx.try_iter());
        for l in &lines {
            let f: Vec<&str> = l.split(' ').collect();
            if f.len() == 4 && f[0] == "D" {
                if let (Ok(lsn), Ok(seq)) = (f[1].parse::<u64>(), f[3].parse::<u64>()) {
                    acked.insert((f[2].to_string(), seq), lsn);
                }
            }
        }
        // Reopen as the next writer would, and check.
        let (mut j, _) = Journal::open(dir.path(), opts(SEGMENT_BYTES, Durability::Always, round))
            .unwrap_or_else(|e| panic!("round {round}: reopen failed: {e} (seed {seed})"));
        for p in IDS {
            let records = j.replay(&pid(p), SequenceNr(1)).unwrap();
            let by_seq: HashMap<u64, (Lsn, &[u8])> = records
                .iter()
                .map(|r| (r.sequence_nr.0, (r.lsn, r.payload.as_slice())))
                .collect();
            // Replayed sequence numbers are contiguous from 1.
            for (i, r) in records.iter().enumerate() {
                assert_eq!(r.sequence_nr.0, i as u64 + 1, "round {round} seed {seed}");
            }
            for ((ap, seq), lsn) in &acked {
                if ap != p {
                    continue;
                }
                let (got_lsn, bytes) = by_seq.get(seq).copied().unwrap_or_else(|| {
                    panic!("round {round}: acknowledged {p} #{seq} (LSN {lsn}) lost (seed {seed})")
                });
                assert_eq!(got_lsn, Lsn(*lsn), "round {round} seed {seed}");
                assert_eq!(
                    bytes,
                    payload(p, *seq).as_slice(),
                    "round {round} seed {seed}"
                );
            }
            // Appends continue at the right sequence number.
            let last = j.highest_sequence_nr(&pid(p));
            assert_eq!(last.0, records.len() as u64);
            assert!(
                matches!(
                    j.append(&pid(p), last, WriterEpoch(round), b"dup"),
                    Err(AppendError::SequenceNotIncreasing { .. })
                        | Err(AppendError::Fenced { .. })
                ) || last.0 == 0
            );
            let l = j
                .append(
                    &pid(p),
                    SequenceNr(last.0 + 1),
                    WriterEpoch(round),
                    &payload(p, last.0 + 1),
                )
                .unwrap();
            j.wait_durable(l).unwrap();
            acked.insert((p.to_string(), last.0 + 1), l.0);
        }
        j.close().unwrap();
        total_acked = acked.len();
    }
    assert!(
        total_acked > 100,
        "only {total_acked} records acknowledged (seed {seed})"
    );
    println!("crash test: 20 rounds, {total_acked} acknowledged records checked");
}
