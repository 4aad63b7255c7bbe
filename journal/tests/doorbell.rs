//! A flush asked for while the sync thread's channel is full is not lost.
//!
//! Under `Durability::None` nothing is flushed until someone waits: the
//! waiter rings the sync thread's doorbell. When the disk is slow, the
//! channel to the sync thread fills with segment rolls; a doorbell that did
//! not fit used to be dropped, and the waiter then slept forever although
//! the sync thread had gone idle.

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use common::{opts, pid};
use shardline_journal::storage::{FaultyStorage, MemoryStorage};
use shardline_journal::{Durability, Journal, SequenceNr, WriterEpoch};

#[test]
fn a_wait_that_rings_while_the_channel_is_full_still_flushes() {
    let faulty = FaultyStorage::new(MemoryStorage::new());
    let faults = faulty.faults();
    // One 2,500-byte event per 4 KiB segment: every append rolls a segment.
    let (mut j, _) =
        Journal::open_with_storage(Arc::new(faulty), opts(4096, Durability::None, 1)).unwrap();
    let watcher = j.watcher();
    let a = pid("counter|a");
    let body = vec![7u8; 2500];
    let first = j.append(&a, SequenceNr(1), WriterEpoch(1), &body).unwrap();
    faults.stall_sync.store(true, Ordering::SeqCst);
    // The appender fills the channel (64 messages) with rolls whose syncs
    // stall, then blocks on the next roll.
    let appender = std::thread::spawn(move || {
        for seq in 2..=200 {
            j.append(&a, SequenceNr(seq), WriterEpoch(1), &body)
                .unwrap();
        }
        j
    });
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        !appender.is_finished(),
        "the appender should be blocked on the full channel"
    );
    // Ring while the channel is full (the appender is blocked on it), then
    // let the disk go on.
    let waiter =
        std::thread::spawn(move || watcher.wait_durable_timeout(first, Duration::from_secs(20)));
    std::thread::sleep(Duration::from_millis(100));
    faults.stall_sync.store(false, Ordering::SeqCst);
    let j = appender.join().unwrap();
    assert!(
        waiter.join().unwrap().unwrap(),
        "the flush asked for while the channel was full never happened"
    );
    j.close().unwrap();
}
