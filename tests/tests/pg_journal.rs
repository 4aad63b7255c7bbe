//! The PostgreSQL journal backend through its library API, against a
//! throwaway server (`pg_support`): schema creation and the version check,
//! the database's identity, group commit (one transaction per batch, split
//! at the batch limits), fencing of two writers racing on one persistence
//! id, an outage (refused, then resumed without a restart), the
//! coordinators' journal on the database (recovery claims an epoch that
//! fences the older incarnation; the state folds back) and the cluster id
//! kept per cluster name.

mod pg_support;

use std::time::{Duration, Instant};

use pg_support::TempPg;
use shardline::persistence::coordinator::{
    CoordinatorConfig, CoordinatorJournalError, RecoveredCoordinator,
};
use shardline::persistence::pg::{self, PgError, PgJournal, PgLog, PgSettings};
use shardline::persistence::pg_control::{self, PgControlJournal};
use shardline::persistence::{DurableWake, EventLog, LogErrorKind};
use shardline_journal::{PersistenceId, SequenceNr, WriterEpoch};
use std::sync::Arc;

fn settings(pg: &TempPg) -> PgSettings {
    PgSettings {
        url: pg.url(),
        pool_size: 2,
        batch_max_rows: 4096,
        batch_max_bytes: 8 << 20,
        connect_timeout: Duration::from_millis(1000),
    }
}

fn pid(s: &str) -> PersistenceId {
    PersistenceId::new(s).expect("pid")
}

/// Appends one event and waits for its outcome: `Ok(())` committed,
/// `Err(kind)` refused.
fn append_one(
    log: &mut PgLog,
    p: &PersistenceId,
    seq: u64,
    epoch: u64,
    payload: &[u8],
) -> Result<(), LogErrorKind> {
    let lsn = log
        .append(p, SequenceNr(seq), WriterEpoch(epoch), payload)
        .map_err(|_| LogErrorKind::Unavailable)?;
    log.wait_durable(lsn)
        .map_err(|_| LogErrorKind::Unavailable)?;
    match log.rejected(p, lsn) {
        Some(e) => Err(e.kind),
        None => Ok(()),
    }
}

#[test]
fn schema_is_created_once_and_a_newer_version_is_refused() {
    let pg = TempPg::start();
    let s = settings(&pg);
    // Several nodes starting at once create the schema once.
    let hs: Vec<_> = (0..4)
        .map(|_| {
            let s = s.clone();
            std::thread::spawn(move || pg::connect(&s).map(|_| ()))
        })
        .collect();
    for h in hs {
        h.join().expect("thread").expect("connect");
    }
    assert_eq!(
        pg.psql("SELECT version FROM shardline_schema"),
        pg::SCHEMA_VERSION.to_string()
    );
    assert_eq!(
        pg.psql(
            "SELECT count(*) FROM pg_tables WHERE tablename IN \
             ('shardline_events','shardline_snapshots','shardline_writers','shardline_schema', \
             'shardline_clusters')"
        ),
        "5"
    );
    // A database of schema version 1 (before `shardline_clusters`) is
    // migrated.
    pg.psql("DROP TABLE shardline_clusters");
    pg.psql("UPDATE shardline_schema SET version = 1");
    pg::connect(&s).expect("migrates version 1");
    assert_eq!(
        pg.psql("SELECT version FROM shardline_schema"),
        pg::SCHEMA_VERSION.to_string()
    );
    assert_eq!(
        pg.psql("SELECT count(*) FROM pg_tables WHERE tablename = 'shardline_clusters'"),
        "1"
    );
    // A database of schema version 2 (before the claim rows' column) is
    // migrated.
    pg.psql("ALTER TABLE shardline_events DROP COLUMN claim");
    pg.psql("UPDATE shardline_schema SET version = 2");
    pg::connect(&s).expect("migrates version 2");
    assert_eq!(
        pg.psql(
            "SELECT count(*) FROM information_schema.columns \
             WHERE table_name = 'shardline_events' AND column_name = 'claim'"
        ),
        "1"
    );
    pg.psql("UPDATE shardline_schema SET version = 99");
    match pg::connect(&s) {
        Err(PgError::SchemaTooNew { found, supported }) => {
            assert_eq!((found, supported), (99, pg::SCHEMA_VERSION));
        }
        other => panic!(
            "a newer schema must be refused, got {:?}",
            other.map(|_| ())
        ),
    }
}

#[test]
fn identity_is_the_system_identifier_and_database() {
    let pg = TempPg::start();
    let s = settings(&pg);
    let id = pg::identity(&s).expect("identity");
    let sys = pg.psql("SELECT system_identifier FROM pg_control_system()");
    assert_eq!(id, format!("postgres:{sys}/postgres"));
    assert_eq!(pg::identity(&s).expect("again"), id, "stable");
}

#[test]
fn one_turn_is_one_transaction_split_at_the_batch_limit() {
    let pg = TempPg::start();
    let mut s = settings(&pg);
    let mut log = PgLog::open(&PgJournal::new(&s), 0);
    // A flush wake nobody polls: appends wait for `flush`, as on a core
    // where the flush task runs at the end of the turn.
    log.set_flush_wake(std::sync::Arc::new(DurableWake::default()));
    let mut last = shardline_journal::Lsn(0);
    for i in 0..100 {
        last = log
            .append(&pid(&format!("g|{i}")), SequenceNr(1), WriterEpoch(1), b"x")
            .expect("append");
    }
    assert_eq!(log.durable_lsn().0, 0, "nothing is sent before the flush");
    log.flush();
    log.wait_durable(last).expect("durable");
    for i in 0..100 {
        assert!(log.rejected(&pid(&format!("g|{i}")), last).is_none());
    }
    assert_eq!(
        pg.psql("SELECT count(*), count(DISTINCT xmin::text) FROM shardline_events WHERE persistence_id LIKE 'g|%'"),
        "100|1",
        "100 events of one turn in one transaction"
    );
    drop(log);
    s.batch_max_rows = 30;
    let mut log = PgLog::open(&PgJournal::new(&s), 0);
    log.set_flush_wake(std::sync::Arc::new(DurableWake::default()));
    for i in 0..100 {
        last = log
            .append(&pid(&format!("h|{i}")), SequenceNr(1), WriterEpoch(1), b"x")
            .expect("append");
    }
    log.flush();
    log.wait_durable(last).expect("durable");
    assert_eq!(
        pg.psql("SELECT count(*), count(DISTINCT xmin::text) FROM shardline_events WHERE persistence_id LIKE 'h|%'"),
        "100|4",
        "batch_max_rows = 30 splits 100 events into 4 transactions"
    );
    // Replay: the snapshot, then the events after it.
    let p = pid("r|1");
    for seq in 1..=5 {
        append_one(&mut log, &p, seq, 1, &[seq as u8]).expect("append");
    }
    log.save_snapshot(&p, SequenceNr(3), WriterEpoch(1), b"snap3")
        .expect("snapshot");
    append_one(&mut log, &p, 6, 1, &[6]).expect("append");
    let rec = log.recover(&p, WriterEpoch(1)).expect("recover");
    assert_eq!(rec.snapshot, Some((3, b"snap3".to_vec())));
    let seqs: Vec<u64> = rec.events.iter().map(|e| e.0).collect();
    assert_eq!(seqs, vec![4, 5, 6]);
}

/// Two incarnations of one persistence id: the old one (epoch 1) appends
/// as fast as it can while the new one (epoch 2) recovers (claiming the id)
/// and appends. Every append of the old one acknowledged is in what the
/// new one recovered; after the claim the old one is refused as fenced and
/// stops; the events in the database are 1..=N without a gap or a
/// duplicate.
#[test]
fn two_writers_racing_on_one_persistence_id_the_older_epoch_is_fenced() {
    let pg = TempPg::start();
    let s = settings(&pg);
    pg::connect(&s).expect("schema");
    let p = pid("counter|race");
    let s2 = s.clone();
    let p2 = p.clone();
    let old = std::thread::spawn(move || {
        let mut a = PgLog::open(&PgJournal::new(&s2), 0);
        let rec = a.recover(&p2, WriterEpoch(1)).expect("recover old");
        assert!(rec.events.is_empty());
        assert_eq!(
            rec.highest,
            pg::CLAIM_ROWS,
            "the claim rows take 1..=CLAIM_ROWS"
        );
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut acked = 0u64;
        loop {
            assert!(Instant::now() < deadline, "old writer never fenced");
            match append_one(&mut a, &p2, rec.highest + acked + 1, 1, b"old") {
                Ok(()) => acked += 1,
                Err(k) => return (acked, k),
            }
        }
    });
    // Let the old writer get some events in.
    let t0 = Instant::now();
    while pg
        .psql("SELECT count(*) FROM shardline_events WHERE persistence_id = 'counter|race'")
        .parse::<u64>()
        .unwrap_or(0)
        < 20
    {
        assert!(t0.elapsed() < Duration::from_secs(20), "old writer idle");
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut b = PgLog::open(&PgJournal::new(&s), 1);
    let rec = b.recover(&p, WriterEpoch(2)).expect("recover new");
    let recovered = rec.events.len() as u64;
    for (i, e) in rec.events.iter().enumerate() {
        assert_eq!(
            e.0,
            i as u64 + pg::CLAIM_ROWS + 1,
            "contiguous after the old claim rows"
        );
    }
    let last_old = rec.events.last().map_or(pg::CLAIM_ROWS, |e| e.0);
    let claim = rec.highest;
    assert!(
        claim > last_old && claim <= last_old + pg::CLAIM_ROWS,
        "the new claim rows follow the events: {claim} after {last_old}"
    );
    for k in 1..=50 {
        append_one(&mut b, &p, claim + k, 2, b"new").expect("new writer appends");
    }
    let (acked_old, kind) = old.join().expect("old thread");
    assert_eq!(
        kind,
        LogErrorKind::Fenced,
        "the older epoch is refused as fenced"
    );
    assert!(
        acked_old <= recovered,
        "an acknowledged append of the old writer ({acked_old}) is missing from the recovery ({recovered})"
    );
    // Claim rows 1..=CLAIM_ROWS (old), the old events, the new claim rows
    // up to `claim`, then the 50 new events: no gap, no duplicate.
    assert_eq!(
        pg.psql(
            "SELECT count(*) FILTER (WHERE NOT claim), count(*) FILTER (WHERE claim AND writer_epoch = 2), \
             min(sequence_nr), max(sequence_nr), count(*) \
             FROM shardline_events WHERE persistence_id = 'counter|race'"
        ),
        format!(
            "{}|{}|1|{n}|{n}",
            recovered + 50,
            claim - last_old,
            n = claim + 50
        )
    );
    assert_eq!(
        pg.psql(&format!(
            "SELECT count(*) FROM shardline_events WHERE persistence_id = 'counter|race' \
             AND writer_epoch = 1 AND sequence_nr > {last_old}"
        )),
        "0",
        "no event of the old epoch after the new one's claim"
    );
    assert_eq!(
        pg.psql("SELECT writer_epoch FROM shardline_writers WHERE persistence_id = 'counter|race'"),
        "2"
    );
}

#[test]
fn an_outage_refuses_appends_then_resumes_without_a_restart() {
    let mut pg = TempPg::start();
    let s = settings(&pg);
    let mut log = PgLog::open(&PgJournal::new(&s), 0);
    let p = pid("counter|out");
    let c = log.recover(&p, WriterEpoch(1)).expect("recover").highest;
    assert_eq!(c, pg::CLAIM_ROWS, "the claim rows");
    append_one(&mut log, &p, c + 1, 1, b"1").expect("append");
    assert!(log.health().is_none());
    pg.stop_server();
    assert_eq!(
        append_one(&mut log, &p, c + 2, 1, b"2"),
        Err(LogErrorKind::Unavailable)
    );
    let why = log.health().expect("health names the cause");
    assert!(why.starts_with("journal unavailable"), "{why}");
    // Until the id is recovered again its appends are refused (a later
    // event must not land after a lost one).
    assert!(log
        .append(&p, SequenceNr(c + 3), WriterEpoch(1), b"3")
        .is_err());
    pg.start_server();
    let deadline = Instant::now() + Duration::from_secs(20);
    let rec = loop {
        match log.recover(&p, WriterEpoch(1)) {
            Ok(r) => break r,
            Err(e) => {
                assert!(Instant::now() < deadline, "never resumed: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    };
    let seqs: Vec<u64> = rec.events.iter().map(|e| e.0).collect();
    assert_eq!(seqs, vec![c + 1], "the refused event is not there");
    let c2 = rec.highest;
    assert_eq!(
        c2,
        c + 1 + pg::CLAIM_ROWS,
        "the second claim rows follow the event"
    );
    append_one(&mut log, &p, c2 + 1, 1, b"2").expect("append after the outage");
    assert!(log.health().is_none(), "health clears");
    assert_eq!(
        pg.psql("SELECT string_agg(sequence_nr::text, ',' ORDER BY sequence_nr) FROM shardline_events WHERE persistence_id = 'counter|out' AND NOT claim"),
        format!("{},{}", c + 1, c2 + 1)
    );
}

/// Waits (bounded) for the coordinator journal's recovery of `t`.
fn recovered(
    j: &mut PgControlJournal,
    t: &str,
) -> Result<RecoveredCoordinator, CoordinatorJournalError> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some((_, r)) = j.take_recovered().into_iter().find(|(n, _)| n == t) {
            return r;
        }
        assert!(Instant::now() < deadline, "recovery of {t} never finished");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn wait_lsn(j: &PgControlJournal, lsn: shardline_journal::Lsn) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while j.durable_lsn() < lsn {
        assert!(Instant::now() < deadline, "lsn {lsn:?} never resolved");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn coordinator_state_on_postgres_recovers_and_fences_the_older_incarnation() {
    use shardline_core::ids::{Address, MemberUid, RegionId, ShardId, UniqueAddress};
    use shardline_core::sharding::{CoordinatorEvent, CoordinatorState, Generation};
    let mut pg = TempPg::start();
    let s = settings(&pg);
    let cfg = CoordinatorConfig {
        number_of_shards: 12,
        hash_name: shardline_core::sharding::SHARD_ID_HASH_NAME.to_string(),
    };
    let region = RegionId {
        member: UniqueAddress {
            address: Address("127.0.0.1:7101".into()),
            uid: MemberUid(7),
        },
        core: 1,
    };
    let wake = Arc::new(DurableWake::default());
    let mut a = PgControlJournal::open(&s, wake.clone());
    a.recover_start("counter", &cfg).expect("start");
    let r = recovered(&mut a, "counter").expect("recover empty");
    assert!(r.source.is_none(), "nothing recorded yet");
    let epoch_a = r.claimed_epoch.expect("claimed");
    let mut st = CoordinatorState::default();
    a.begin("counter", epoch_a, &st, &cfg).expect("begin");
    let mut events = vec![CoordinatorEvent::ShardRegionRegistered {
        region: region.clone(),
    }];
    for i in 0..5u32 {
        events.push(CoordinatorEvent::ShardHomeAllocated {
            shard: ShardId(i),
            region: region.clone(),
            generation: Generation(100 + u64::from(i)),
        });
    }
    let mut last = shardline_journal::Lsn(0);
    for (i, e) in events.iter().enumerate() {
        last = a.append("counter", e).expect("append");
        st.apply(e);
        if i == 2 {
            a.save_snapshot("counter", &st, &cfg).expect("snapshot");
        }
    }
    wait_lsn(&a, last);
    assert!(a.take_refused().is_empty(), "committed");
    assert_eq!(
        pg.psql(
            "SELECT count(*) FROM shardline_events WHERE persistence_id = 'coordinator|counter' AND NOT claim"
        ),
        "7",
        "takeover record and six events"
    );
    // A second incarnation (another node) recovers the same state and
    // claims a higher epoch.
    let wake_b = Arc::new(DurableWake::default());
    let mut b = PgControlJournal::open(&s, wake_b.clone());
    b.recover_start("counter", &cfg).expect("start");
    let r = recovered(&mut b, "counter").expect("recover");
    assert_eq!(r.state, st);
    assert!(r.from_database);
    assert_eq!(r.highest_epoch, epoch_a);
    let epoch_b = r.claimed_epoch.expect("claimed");
    assert!(epoch_b > epoch_a);
    assert_eq!(
        r.records, 4,
        "snapshot at the third event, then three events"
    );
    b.begin("counter", epoch_b, &r.state, &cfg).expect("begin");
    // The old incarnation's late append is refused by the database.
    let late = a
        .append(
            "counter",
            &CoordinatorEvent::ShardUnallocated { shard: ShardId(1) },
        )
        .expect("queued");
    wait_lsn(&a, late);
    let refused = a.take_refused();
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert!(refused[0].1.contains("fenced"), "{refused:?}");
    // A config that disagrees with the recorded one is refused.
    let mut c = PgControlJournal::open(&s, Arc::new(DurableWake::default()));
    let other = CoordinatorConfig {
        number_of_shards: 24,
        ..cfg.clone()
    };
    c.recover_start("counter", &other).expect("start");
    match recovered(&mut c, "counter") {
        Err(CoordinatorJournalError::ConfigMismatch {
            recorded_shards: 12,
            configured_shards: 24,
            ..
        }) => {}
        other => panic!("config mismatch expected: {other:?}"),
    }
    drop(c);
    // While the database is down the recovery waits (and says why), and
    // finishes once it is back.
    pg.stop_server();
    let wake_d = Arc::new(DurableWake::default());
    let mut d = PgControlJournal::open(&s, wake_d.clone());
    d.recover_start("counter", &cfg).expect("start");
    let deadline = Instant::now() + Duration::from_secs(20);
    while d.health().is_none() {
        assert!(Instant::now() < deadline, "the outage is never named");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        d.health()
            .is_some_and(|h| h.contains("journal unavailable")),
        "{:?}",
        d.health()
    );
    assert!(d.take_recovered().is_empty(), "no recovery while down");
    pg.start_server();
    let r = recovered(&mut d, "counter").expect("recover after the outage");
    assert_eq!(r.state, st, "the fenced append is not in the state");
    assert!(r.claimed_epoch.expect("claimed") > epoch_b);
    assert!(d.health().is_none());
}

#[test]
fn the_cluster_id_is_kept_per_cluster_name() {
    let pg = TempPg::start();
    let s = settings(&pg);
    let hs: Vec<_> = (0..4)
        .map(|i| {
            let s = s.clone();
            std::thread::spawn(move || pg_control::cluster_id(&s, "one", &format!("id-{i}")))
        })
        .collect();
    let ids: Vec<String> = hs
        .into_iter()
        .map(|h| h.join().expect("thread").expect("cluster id"))
        .collect();
    assert!(ids.iter().all(|i| *i == ids[0]), "one winner: {ids:?}");
    assert_eq!(
        pg_control::cluster_id(&s, "one", "later").expect("again"),
        ids[0]
    );
    assert_eq!(
        pg_control::cluster_id(&s, "two", "id-two").expect("other name"),
        "id-two"
    );
}

/// A claim of a newer epoch races appends of the older one that are in
/// flight, many rounds: each round an old incarnation (epoch 1) appends to
/// 16 ids as fast as it can (one statement carries all of them) while a
/// new one (epoch 2) claims and recovers them one by one. The old writer
/// ends fenced on every id; every event of the old epoch it had
/// acknowledged, and every one in the database, is in what the new
/// incarnation recovered; no event of epoch 1 was committed after the
/// claim of its id (commit timestamps: `track_commit_timestamp`); and the
/// old epoch's events are 1..=n without a gap.
#[test]
fn a_newer_claim_racing_in_flight_appends_of_the_older_epoch_commits_none_after_it() {
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicU64, Ordering};
    const IDS: usize = 16;
    const ROUNDS: usize = 40;
    let pg = TempPg::start();
    let s = settings(&pg);
    pg::connect(&s).expect("schema");
    let mut claimer = PgLog::open(&PgJournal::new(&s), 1);
    let mut old = PgLog::open(&PgJournal::new(&s), 0);
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut claims_without_progress = 0usize;
    for round in 0..ROUNDS {
        let ids: Vec<PersistenceId> = (0..IDS)
            .map(|i| pid(&format!("fence{round}|{i}")))
            .collect();
        for p in &ids {
            let rec = old.recover(p, WriterEpoch(1)).expect("recover old");
            assert_eq!(rec.highest, pg::CLAIM_ROWS, "the old claim rows");
        }
        let statements = Arc::new(AtomicU64::new(0));
        let st = statements.clone();
        let ids2 = ids.clone();
        let writer = std::thread::spawn(move || {
            let mut acked: HashMap<String, u64> = HashMap::new();
            let mut live: Vec<PersistenceId> = ids2.clone();
            let mut next = pg::CLAIM_ROWS + 1;
            while !live.is_empty() {
                assert!(Instant::now() < deadline, "old writer never fenced");
                let mut sent = Vec::new();
                for p in &live {
                    let lsn = old
                        .append(p, SequenceNr(next), WriterEpoch(1), b"old")
                        .expect("append queued");
                    sent.push((p.clone(), lsn));
                }
                let last = sent.last().expect("one").1;
                old.wait_durable(last).expect("outcome");
                let mut still = Vec::new();
                for (p, lsn) in sent {
                    match old.rejected(&p, lsn) {
                        None => {
                            acked.insert(p.as_str().to_string(), next);
                            still.push(p);
                        }
                        Some(e) => assert_eq!(e.kind, LogErrorKind::Fenced, "{}", e.message),
                    }
                }
                live = still;
                next += 1;
                st.fetch_add(1, Ordering::SeqCst);
            }
            (old, acked)
        });
        // Claim while the old writer's statements are in flight: after a
        // few of them, and a varying pause between the claims.
        while statements.load(Ordering::SeqCst) < 2 + (round as u64 % 3) {
            assert!(Instant::now() < deadline, "old writer idle");
            std::thread::yield_now();
        }
        let mut recovered: HashMap<String, (u64, u64)> = HashMap::new();
        for (i, p) in ids.iter().enumerate() {
            let before = statements.load(Ordering::SeqCst);
            let rec = claimer
                .recover(p, WriterEpoch(2))
                .expect("claim and recover");
            if statements.load(Ordering::SeqCst) == before {
                claims_without_progress += 1;
            }
            for (k, e) in rec.events.iter().enumerate() {
                assert_eq!(
                    e.0,
                    k as u64 + pg::CLAIM_ROWS + 1,
                    "contiguous after the old claim rows"
                );
            }
            let last_old = rec.events.last().map_or(pg::CLAIM_ROWS, |e| e.0);
            assert!(
                rec.highest > last_old && rec.highest <= last_old + pg::CLAIM_ROWS,
                "the new claim rows follow the old epoch's events"
            );
            recovered.insert(
                p.as_str().to_string(),
                (
                    rec.events.len() as u64,
                    rec.events.last().map_or(0, |e| e.0),
                ),
            );
            if i % 4 == round % 4 {
                std::thread::sleep(Duration::from_micros(300));
            }
        }
        let (o, acked) = writer.join().expect("old writer");
        old = o;
        // Per id: the old epoch's events (count, highest), those committed
        // after the claim, and the recorded epoch; one query per round.
        let rows = pg.psql(&format!(
            "SELECT count(e.sequence_nr), coalesce(max(e.sequence_nr), 0), \
             count(*) FILTER (WHERE pg_xact_commit_timestamp(e.xmin) > pg_xact_commit_timestamp(w.xmin)), \
             w.writer_epoch, w.persistence_id \
             FROM shardline_writers w LEFT JOIN shardline_events e \
             ON e.persistence_id = w.persistence_id AND e.writer_epoch = 1 AND NOT e.claim \
             WHERE w.persistence_id LIKE 'fence{round}|%' GROUP BY w.persistence_id, w.writer_epoch"
        ));
        let mut seen = 0;
        for line in rows.lines() {
            // count|highest|late|epoch|persistence id (which has a '|').
            let f: Vec<&str> = line.splitn(5, '|').collect();
            let p = f[4];
            let (count, got) = *recovered
                .get(p)
                .unwrap_or_else(|| panic!("round {round}: {p} not claimed: {rows}"));
            let a = acked.get(p).copied().unwrap_or(0);
            assert!(
                a <= got,
                "round {round}, {p}: acknowledged up to {a}, recovered only {got}"
            );
            assert_eq!(
                (f[0], f[1]),
                (count.to_string().as_str(), got.to_string().as_str()),
                "round {round}, {p}: the old epoch's events are exactly what was recovered"
            );
            assert_eq!(
                f[2], "0",
                "round {round}, {p}: an event of the old epoch committed after the newer claim"
            );
            assert_eq!(f[3], "2", "round {round}, {p}: the newer epoch is recorded");
            seen += 1;
        }
        assert_eq!(seen, IDS, "round {round}: {rows}");
    }
    // The race was real: claims ran while statements of the old epoch
    // were being sent (not all after the writer stopped).
    assert!(
        claims_without_progress < ROUNDS * IDS,
        "no claim overlapped an append"
    );
}

/// Two writers append to the same 256 ids concurrently, one in ascending
/// and one in descending order, 60 rounds, each its own sequence numbers,
/// with snapshot saves of every id every fourth round (upserts of the same
/// snapshot rows: row locks both statements take). Every append commits
/// (a deadlock, 40P01, would refuse a statement's appends as unavailable)
/// and the server logs no deadlock.
#[test]
fn two_writers_appending_to_the_same_ids_in_opposite_orders_never_deadlock() {
    const IDS: u64 = 256;
    const ROUNDS: u64 = 60;
    let pg = TempPg::start();
    let s = settings(&pg);
    pg::connect(&s).expect("schema");
    let barrier = Arc::new(std::sync::Barrier::new(2));
    let deadline = Instant::now() + Duration::from_secs(60);
    let hs: Vec<_> = [false, true]
        .into_iter()
        .enumerate()
        .map(|(w, descending)| {
            let s = s.clone();
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                let mut log = PgLog::open(&PgJournal::new(&s), w as u16);
                // Appends wait for `flush`: one statement per round.
                log.set_flush_wake(Arc::new(DurableWake::default()));
                let mut order: Vec<u64> = (0..IDS).collect();
                if descending {
                    order.reverse();
                }
                for round in 1..=ROUNDS {
                    assert!(Instant::now() < deadline, "rounds too slow");
                    let epoch = round.div_ceil(2);
                    let seq = 2 * round - 1 + w as u64;
                    barrier.wait();
                    let mut sent = Vec::new();
                    for i in &order {
                        let p = pid(&format!("dl|{i}"));
                        let lsn = log
                            .append(&p, SequenceNr(seq), WriterEpoch(epoch), b"e")
                            .expect("append");
                        if round % 4 == 0 {
                            log.save_snapshot(&p, SequenceNr(seq), WriterEpoch(epoch), b"s")
                                .expect("snapshot");
                        }
                        sent.push((p, lsn));
                    }
                    log.flush();
                    let last = sent.last().expect("one").1;
                    log.wait_durable(last).expect("outcome");
                    for (p, lsn) in &sent {
                        if let Some(e) = log.rejected(p, *lsn) {
                            panic!("round {round}, writer {w}, {p:?}: {}", e.message);
                        }
                    }
                }
            })
        })
        .collect();
    for h in hs {
        h.join().expect("writer");
    }
    assert_eq!(
        pg.psql("SELECT count(*), count(DISTINCT persistence_id) FROM shardline_events WHERE persistence_id LIKE 'dl|%'"),
        format!("{}|{IDS}", 2 * ROUNDS * IDS)
    );
    assert_eq!(
        pg.psql("SELECT count(*) FROM shardline_snapshots WHERE persistence_id LIKE 'dl|%'"),
        IDS.to_string()
    );
    let log = pg.server_log();
    assert!(
        !log.contains("deadlock detected"),
        "the server logged a deadlock: {log}"
    );
}

/// An append without a claim before it (an API caller that appends
/// first) is stored at its sequence number; a recovery's claim row then
/// fences that writer: its next append is refused as fenced, the claimer
/// continues after its claim row, and an older epoch's claim is refused.
#[test]
fn an_append_without_a_claim_is_fenced_by_the_next_claim() {
    let pg = TempPg::start();
    let s = settings(&pg);
    let p = pid("counter|noclaim");
    let mut a = PgLog::open(&PgJournal::new(&s), 0);
    append_one(&mut a, &p, 1, 5, b"1").expect("first append, no claim");
    append_one(&mut a, &p, 2, 5, b"2").expect("second append, no claim");
    let mut b = PgLog::open(&PgJournal::new(&s), 1);
    let rec = b.recover(&p, WriterEpoch(6)).expect("claim");
    assert_eq!(rec.events, vec![(1, b"1".to_vec()), (2, b"2".to_vec())]);
    assert_eq!(
        rec.highest,
        2 + pg::CLAIM_ROWS,
        "the claim rows follow the events"
    );
    assert_eq!(
        append_one(&mut a, &p, 3, 5, b"3"),
        Err(LogErrorKind::Fenced),
        "the writer before the claim"
    );
    append_one(&mut b, &p, rec.highest + 1, 6, b"4")
        .expect("the claimer appends after its claim rows");
    let mut c = PgLog::open(&PgJournal::new(&s), 2);
    match c.recover(&p, WriterEpoch(5)) {
        Err(e) => assert!(e.contains("fenced"), "{e}"),
        Ok(r) => panic!("an older epoch's claim must be refused: {r:?}"),
    }
    assert_eq!(
        pg.psql("SELECT string_agg(sequence_nr || ':' || writer_epoch, ',' ORDER BY sequence_nr) FROM shardline_events WHERE persistence_id = 'counter|noclaim' AND NOT claim"),
        format!("1:5,2:5,{}:6", rec.highest + 1)
    );
    assert_eq!(
        pg.psql("SELECT count(*), min(sequence_nr), max(sequence_nr) FROM shardline_events WHERE persistence_id = 'counter|noclaim' AND claim"),
        format!("{}|3|{}", pg::CLAIM_ROWS, rec.highest)
    );
    assert_eq!(
        pg.psql(
            "SELECT writer_epoch FROM shardline_writers WHERE persistence_id = 'counter|noclaim'"
        ),
        "6"
    );
}

/// An older incarnation's turn carries more of one id's events than one
/// statement takes (`batch_max_rows = 1`): the first statement collides
/// with the newer claim row and is refused as fenced, and the id's later
/// events of the same turn are refused with it (none commits after the
/// claim, where it would take the newer incarnation's next sequence
/// number and fence the newer incarnation instead).
#[test]
fn an_older_incarnations_turn_split_over_statements_commits_nothing_after_the_claim() {
    let pg = TempPg::start();
    let mut s = settings(&pg);
    s.batch_max_rows = 1;
    let p = pid("counter|split");
    let mut old = PgLog::open(&PgJournal::new(&s), 0);
    const C: u64 = pg::CLAIM_ROWS;
    assert_eq!(old.recover(&p, WriterEpoch(1)).expect("claim").highest, C);
    append_one(&mut old, &p, C + 1, 1, b"2").expect("durable before the claim");
    let mut new = PgLog::open(&PgJournal::new(&s), 1);
    let rec = new.recover(&p, WriterEpoch(2)).expect("newer claim");
    assert_eq!(
        rec.highest,
        2 * C + 1,
        "the newer claim rows follow the event"
    );
    // One turn of the older incarnation: the next three sequence numbers.
    old.set_flush_wake(Arc::new(DurableWake::default()));
    let turn = C + 2..=C + 4;
    let lsns: Vec<_> = turn
        .clone()
        .map(|seq| {
            old.append(&p, SequenceNr(seq), WriterEpoch(1), b"old")
                .expect("append queued")
        })
        .collect();
    old.flush();
    old.wait_durable(*lsns.last().expect("three"))
        .expect("outcome");
    for (seq, lsn) in turn.zip(&lsns) {
        assert!(
            old.rejected(&p, *lsn).is_some(),
            "the older incarnation's event {seq} was acknowledged after the newer claim"
        );
    }
    assert_eq!(
        pg.psql("SELECT count(*) FILTER (WHERE claim AND writer_epoch = 1), string_agg(sequence_nr || ':' || writer_epoch, ',' ORDER BY sequence_nr) FILTER (WHERE NOT claim), count(*) FILTER (WHERE claim AND writer_epoch = 2), max(sequence_nr) FROM shardline_events WHERE persistence_id = 'counter|split'"),
        format!("{C}|{}:1|{C}|{}", C + 1, 2 * C + 1),
        "no event of the older epoch after the newer claim rows"
    );
    append_one(&mut new, &p, 2 * C + 2, 2, b"4")
        .expect("the newer incarnation appends after its claim row");
}

/// A version 2 database with data (events, a snapshot and a recorded
/// writer epoch, no `claim` column) is migrated in place: its events all
/// read as events (none as a claim row), the first recovery's claim row
/// follows the highest of them, the recorded epoch still fences an older
/// claim, and the incarnation before the upgrade is fenced at its next
/// append.
#[test]
fn a_version_2_database_with_data_is_migrated_and_recovers_its_events() {
    let pg = TempPg::start();
    let s = settings(&pg);
    pg::connect(&s).expect("schema");
    pg.psql("ALTER TABLE shardline_events DROP COLUMN claim");
    pg.psql("UPDATE shardline_schema SET version = 2");
    pg.psql(
        "INSERT INTO shardline_writers VALUES ('counter|v2', 3); \
         INSERT INTO shardline_events SELECT 'counter|v2', n, 3, int4send(n::int) FROM generate_series(1, 5) AS n; \
         INSERT INTO shardline_snapshots VALUES ('counter|v2', 2, 3, 'snap2')",
    );
    let p = pid("counter|v2");
    let mut log = PgLog::open(&PgJournal::new(&s), 0);
    match log.recover(&p, WriterEpoch(2)) {
        Err(e) => assert!(e.contains("fenced"), "{e}"),
        Ok(r) => panic!("the epoch recorded before the upgrade fences an older one: {r:?}"),
    }
    let rec = log
        .recover(&p, WriterEpoch(4))
        .expect("recover after the upgrade");
    assert_eq!(
        pg.psql("SELECT version FROM shardline_schema"),
        pg::SCHEMA_VERSION.to_string()
    );
    assert_eq!(rec.snapshot, Some((2, b"snap2".to_vec())));
    let events: Vec<(u64, Vec<u8>)> = (3..=5u32)
        .map(|n| (u64::from(n), n.to_be_bytes().to_vec()))
        .collect();
    assert_eq!(rec.events, events, "the version 2 events, none a claim row");
    assert_eq!(
        rec.highest,
        5 + pg::CLAIM_ROWS,
        "the claim rows follow the version 2 events"
    );
    let mut old = PgLog::open(&PgJournal::new(&s), 1);
    assert_eq!(
        append_one(&mut old, &p, 6, 3, b"old"),
        Err(LogErrorKind::Fenced),
        "the incarnation from before the upgrade (another node's log)"
    );
    append_one(&mut log, &p, rec.highest + 1, 4, b"7")
        .expect("the new incarnation appends after its claim rows");
    let again = log.recover(&p, WriterEpoch(5)).expect("recover again");
    assert_eq!(again.events.len(), 4, "3, 4, 5 and the new one: {again:?}");
    assert_eq!(again.highest, rec.highest + 1 + pg::CLAIM_ROWS);
}

/// `journal.url`'s own `options` are kept: a `search_path` in them puts
/// the journal's tables in that schema (the generic plans are still set).
#[test]
fn the_urls_options_are_kept_a_search_path_places_the_tables() {
    let pg = TempPg::start();
    pg.psql("CREATE SCHEMA sl");
    let mut s = settings(&pg);
    s.url = format!("{}?options=-c%20search_path%3Dsl", pg.url());
    let mut c = pg::connect(&s).expect("connect with options");
    for (what, want) in [
        ("search_path", "sl"),
        ("plan_cache_mode", "force_generic_plan"),
    ] {
        let got: String = c
            .query_one(&format!("SHOW {what}"), &[])
            .expect("show")
            .get(0);
        assert_eq!(got, want, "{what}");
    }
    assert_eq!(
        pg.psql("SELECT string_agg(DISTINCT schemaname, ',') FROM pg_tables WHERE tablename LIKE 'shardline_%'"),
        "sl",
        "the tables are in the url's search_path"
    );
    let p = pid("counter|opts");
    let mut log = PgLog::open(&PgJournal::new(&s), 0);
    let c = log.recover(&p, WriterEpoch(1)).expect("claim").highest;
    assert_eq!(c, pg::CLAIM_ROWS);
    append_one(&mut log, &p, c + 1, 1, b"2").expect("append");
    assert_eq!(
        pg.psql("SELECT count(*) FROM sl.shardline_events WHERE persistence_id = 'counter|opts'"),
        (pg::CLAIM_ROWS + 1).to_string()
    );
}

/// A TCP proxy in front of the server that can lose one answer: once
/// armed, the server's reply to the next `Bind` (the execution of a
/// statement, after it reached the server) is dropped and the connection
/// is closed, as when a network fails between a commit and its reply.
struct LossyProxy {
    port: u16,
    armed: Arc<std::sync::atomic::AtomicBool>,
    lost: Arc<std::sync::atomic::AtomicUsize>,
}

impl LossyProxy {
    fn start(server_port: u16) -> LossyProxy {
        use std::io::{Read, Write};
        use std::net::{Shutdown, TcpListener, TcpStream};
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        let listener = TcpListener::bind("127.0.0.1:0").expect("proxy bind");
        let port = listener.local_addr().expect("addr").port();
        let armed = Arc::new(AtomicBool::new(false));
        let lost = Arc::new(AtomicUsize::new(0));
        let (a, l) = (armed.clone(), lost.clone());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                let Ok(server) = TcpStream::connect(("127.0.0.1", server_port)) else {
                    continue;
                };
                let drop_reply = Arc::new(AtomicBool::new(false));
                let (mut c_in, mut s_out) = (
                    client.try_clone().expect("clone"),
                    server.try_clone().expect("clone"),
                );
                let (armed, flag) = (a.clone(), drop_reply.clone());
                std::thread::spawn(move || {
                    let mut buf = vec![0u8; 64 * 1024];
                    while let Ok(n) = c_in.read(&mut buf) {
                        if n == 0 {
                            break;
                        }
                        if buf[0] == b'B' && armed.swap(false, Ordering::SeqCst) {
                            flag.store(true, Ordering::SeqCst);
                        }
                        if s_out.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                    let _ = s_out.shutdown(Shutdown::Both);
                });
                let (mut s_in, mut c_out, lost) = (server, client, l.clone());
                std::thread::spawn(move || {
                    let mut buf = vec![0u8; 64 * 1024];
                    while let Ok(n) = s_in.read(&mut buf) {
                        if n == 0 {
                            break;
                        }
                        if drop_reply.load(Ordering::SeqCst) {
                            lost.fetch_add(1, Ordering::SeqCst);
                            break;
                        }
                        if c_out.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                    let _ = c_out.shutdown(Shutdown::Both);
                    let _ = s_in.shutdown(Shutdown::Both);
                });
            }
        });
        LossyProxy { port, armed, lost }
    }
}

#[test]
fn a_coordinator_append_whose_commit_reply_was_lost_is_not_reported_fenced() {
    use shardline_core::ids::{Address, MemberUid, RegionId, ShardId, UniqueAddress};
    use shardline_core::sharding::{CoordinatorEvent, CoordinatorState, Generation};
    use std::sync::atomic::Ordering;
    let pg = TempPg::start();
    let proxy = LossyProxy::start(pg.port());
    let mut s = settings(&pg);
    s.url = s
        .url
        .replace(&format!(":{}/", pg.port()), &format!(":{}/", proxy.port));
    assert!(s.url.contains(&proxy.port.to_string()), "{}", s.url);
    let cfg = CoordinatorConfig {
        number_of_shards: 12,
        hash_name: shardline_core::sharding::SHARD_ID_HASH_NAME.to_string(),
    };
    let region = RegionId {
        member: UniqueAddress {
            address: Address("127.0.0.1:7101".into()),
            uid: MemberUid(7),
        },
        core: 0,
    };
    let mut j = PgControlJournal::open(&s, Arc::new(DurableWake::default()));
    j.recover_start("counter", &cfg).expect("start");
    let r = recovered(&mut j, "counter").expect("recover");
    let epoch = r.claimed_epoch.expect("claimed");
    let st = CoordinatorState::default();
    j.begin("counter", epoch, &st, &cfg).expect("begin");
    let first = j
        .append(
            "counter",
            &CoordinatorEvent::ShardRegionRegistered {
                region: region.clone(),
            },
        )
        .expect("append");
    wait_lsn(&j, first);
    assert!(j.take_refused().is_empty(), "the first append committed");
    // The next statement commits, but its answer is lost with the
    // connection; the journal reconnects and sends it again.
    proxy.armed.store(true, Ordering::SeqCst);
    let second = j
        .append(
            "counter",
            &CoordinatorEvent::ShardHomeAllocated {
                shard: ShardId(3),
                region: region.clone(),
                generation: Generation(7),
            },
        )
        .expect("append");
    wait_lsn(&j, second);
    assert_eq!(proxy.lost.load(Ordering::SeqCst), 1, "one answer was lost");
    let refused = j.take_refused();
    assert!(
        refused.is_empty(),
        "its own committed rows are not a newer incarnation: {refused:?}"
    );
    assert_eq!(
        pg.psql(
            "SELECT count(*) FROM shardline_events WHERE persistence_id = 'coordinator|counter' AND NOT claim"
        ),
        "3",
        "takeover record and two events, each once"
    );
    // The next append goes on after them.
    let third = j
        .append(
            "counter",
            &CoordinatorEvent::ShardHomeAllocated {
                shard: ShardId(4),
                region: region.clone(),
                generation: Generation(8),
            },
        )
        .expect("append");
    wait_lsn(&j, third);
    assert!(j.take_refused().is_empty());
    drop(j);
    // A recovery folds all three.
    let mut k = PgControlJournal::open(&settings(&pg), Arc::new(DurableWake::default()));
    k.recover_start("counter", &cfg).expect("start");
    let r = recovered(&mut k, "counter").expect("recover");
    assert!(r.state.regions.contains_key(&region), "{:?}", r.state);
    assert_eq!(r.state.last_generation, Generation(8), "{:?}", r.state);
    assert_eq!(
        r.state.shards.keys().copied().collect::<Vec<_>>(),
        vec![ShardId(3), ShardId(4)],
        "{:?}",
        r.state
    );
}
