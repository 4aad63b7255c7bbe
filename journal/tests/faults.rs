//! Fencing, poisoning after a failed flush or write, and ENOSPC when
//! preallocating a segment.

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use common::{opts, pid};
use shardline_journal::storage::{FaultyStorage, MemoryStorage};
use shardline_journal::{
    AppendError, CloseError, Durability, DurabilityError, Journal, OpenError, SequenceNr,
    SnapshotError, WriterEpoch,
};

#[test]
fn fencing_rejects_lower_epochs_per_persistence_id() {
    let storage = MemoryStorage::new();
    let (mut j, _) =
        Journal::open_with_storage(Arc::new(storage.clone()), opts(4096, Durability::None, 0))
            .unwrap();
    let (a, b) = (pid("a"), pid("b"));
    j.append(&a, SequenceNr(1), WriterEpoch(1), b"e1").unwrap();
    j.append(&a, SequenceNr(2), WriterEpoch(2), b"e2").unwrap();
    // Epoch 1 was superseded by epoch 2 for `a`.
    match j.append(&a, SequenceNr(3), WriterEpoch(1), b"zombie") {
        Err(AppendError::Fenced {
            persistence_id,
            epoch,
            highest,
        }) => {
            assert_eq!(persistence_id, a);
            assert_eq!(epoch, WriterEpoch(1));
            assert_eq!(highest, WriterEpoch(2));
        }
        other => panic!("expected fencing, got {other:?}"),
    }
    assert!(matches!(
        j.delete_to(&a, SequenceNr(1), WriterEpoch(1)),
        Err(AppendError::Fenced { .. })
    ));
    assert!(matches!(
        j.save_snapshot(&a, SequenceNr(2), WriterEpoch(1), b"s"),
        Err(SnapshotError::Fenced { .. })
    ));
    // Another id is not affected; equal epochs are fine.
    j.append(&b, SequenceNr(1), WriterEpoch(1), b"x").unwrap();
    j.append(&a, SequenceNr(3), WriterEpoch(2), b"e3").unwrap();
    j.close().unwrap();
    // Fencing survives a reopen.
    let (mut j, _) =
        Journal::open_with_storage(Arc::new(storage), opts(4096, Durability::None, 0)).unwrap();
    assert_eq!(j.writer_epoch_of(&a), WriterEpoch(2));
    assert!(matches!(
        j.append(&a, SequenceNr(4), WriterEpoch(1), b"zombie"),
        Err(AppendError::Fenced { .. })
    ));
    assert_eq!(j.replay(&a, SequenceNr(1)).unwrap().len(), 3);
}

#[test]
fn failed_flush_poisons_the_journal() {
    let storage = FaultyStorage::new(MemoryStorage::new());
    let faults = storage.faults();
    let (mut j, _) =
        Journal::open_with_storage(Arc::new(storage.clone()), opts(4096, Durability::Always, 0))
            .unwrap();
    let p = pid("p");
    let l1 = j.append(&p, SequenceNr(1), WriterEpoch(0), b"ok").unwrap();
    j.wait_durable(l1).unwrap();
    faults.fail_sync.store(true, Ordering::SeqCst);
    let l2 = j
        .append(&p, SequenceNr(2), WriterEpoch(0), b"lost")
        .unwrap();
    let w = j.watcher();
    assert!(matches!(
        w.wait_durable(l2),
        Err(DurabilityError::Poisoned { .. })
    ));
    assert!(!w.is_durable(l2));
    assert!(w.poisoned().unwrap().contains("fdatasync"));
    // The failed flush is never retried and acknowledged: even with the
    // fault gone, the journal stays poisoned.
    faults.fail_sync.store(false, Ordering::SeqCst);
    match j.append(&p, SequenceNr(3), WriterEpoch(0), b"x") {
        Err(AppendError::Poisoned { reason }) => {
            assert!(reason.contains("EIO") || reason.contains("Input/output"))
        }
        other => panic!("expected poisoning, got {other:?}"),
    }
    assert!(!w
        .wait_durable_timeout(l2, Duration::from_millis(10))
        .unwrap_or(false));
    let (tx, rx) = std::sync::mpsc::channel();
    w.on_durable(l2, move |r| tx.send(r).unwrap());
    assert!(matches!(
        rx.recv().unwrap(),
        Err(DurabilityError::Poisoned { .. })
    ));
    assert!(matches!(j.close(), Err(CloseError::Poisoned { .. })));
}

#[test]
fn failed_write_poisons_the_journal() {
    let storage = FaultyStorage::new(MemoryStorage::new());
    let faults = storage.faults();
    let (mut j, _) =
        Journal::open_with_storage(Arc::new(storage), opts(4096, Durability::None, 0)).unwrap();
    let p = pid("p");
    j.append(&p, SequenceNr(1), WriterEpoch(0), b"ok").unwrap();
    faults.fail_write.store(true, Ordering::SeqCst);
    assert!(matches!(
        j.append(&p, SequenceNr(2), WriterEpoch(0), b"x"),
        Err(AppendError::Io { .. })
    ));
    faults.fail_write.store(false, Ordering::SeqCst);
    assert!(matches!(
        j.append(&p, SequenceNr(2), WriterEpoch(0), b"x"),
        Err(AppendError::Poisoned { .. })
    ));
}

#[test]
fn enospc_on_preallocation() {
    // At open: the first segment cannot be preallocated.
    let storage = FaultyStorage::new(MemoryStorage::new());
    let faults = storage.faults();
    faults.fail_preallocate.store(true, Ordering::SeqCst);
    match Journal::open_with_storage(Arc::new(storage.clone()), opts(4096, Durability::None, 0)) {
        Err(OpenError::Io { source, .. }) => assert_eq!(source.raw_os_error(), Some(libc::ENOSPC)),
        other => panic!("expected ENOSPC, got {:?}", other.map(|_| ())),
    }
    faults.fail_preallocate.store(false, Ordering::SeqCst);

    // On a roll: the append fails with a typed error, the journal is not
    // poisoned, and appends resume once space is back.
    let (mut j, _) =
        Journal::open_with_storage(Arc::new(storage.clone()), opts(4096, Durability::None, 0))
            .unwrap();
    let p = pid("p");
    let mut seq = 0;
    // Fill the first segment; its spare was prepared before the fault.
    while j.segment_count() == 1 {
        if seq == 20 {
            faults.fail_preallocate.store(true, Ordering::SeqCst);
        }
        seq += 1;
        j.append(&p, SequenceNr(seq), WriterEpoch(0), &[5u8; 200])
            .unwrap();
    }
    faults.fail_preallocate.store(true, Ordering::SeqCst);
    let mut failed = None;
    for _ in 0..100 {
        match j.append(&p, SequenceNr(seq + 1), WriterEpoch(0), &[5u8; 200]) {
            Ok(_) => seq += 1,
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
    }
    match failed {
        Some(AppendError::SegmentAllocation { source }) => {
            assert_eq!(source.raw_os_error(), Some(libc::ENOSPC))
        }
        other => panic!("expected a segment allocation error, got {other:?}"),
    }
    faults.fail_preallocate.store(false, Ordering::SeqCst);
    let mut ok = false;
    for _ in 0..3 {
        if j.append(&p, SequenceNr(seq + 1), WriterEpoch(0), &[5u8; 200])
            .is_ok()
        {
            ok = true;
            seq += 1;
            break;
        }
    }
    assert!(ok, "appends resume after ENOSPC clears");
    j.close().unwrap();
    let (j, _) =
        Journal::open_with_storage(Arc::new(storage), opts(4096, Durability::None, 0)).unwrap();
    assert_eq!(j.replay(&p, SequenceNr(1)).unwrap().len() as u64, seq);
}
