//! The control executor: membership (`ClusterNode`), the coordinator
//! singleton (one `ShardCoordinator` per entity type while this member is
//! the oldest), the control lanes to other members, and the cluster
//! listener (which hands data lanes over to the data executors).

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::os::fd::IntoRawFd;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use monoio::io::Splitable;
use shardline_core::cluster::{
    self as cl, ClusterConfig, ClusterEvent, ClusterNode, CurrentClusterState, DowningConfig,
    SbrConfig, SingletonCommand, StopReason,
};
use shardline_core::ids::{Address, MemberUid, RegionId, UniqueAddress};
use shardline_core::sharding::{
    CoordinatorEffect, CoordinatorEvent, CoordinatorMsg, CoordinatorSettings, CoordinatorState,
    Generation, LeastShardAllocationStrategy, MemberStatus as ShMemberStatus, MembershipEvent,
    RegionMsg, ShardCoordinator, SHARD_ID_HASH_NAME,
};

use super::admin::{AdminAnswer, CoordinatorCommand};
use super::msg::{sharding_event, ClusterView, StatsEvent, ToControl, ToCore};
use super::{MemberStatusView, Shared};
use crate::config::NodeConfig;
use crate::envelope::{decode_frame_body, encode_frame, FrameError, MAX_FRAME_SIZE_BYTES};
use crate::envelope::{ControlFrame, Hello, Lane, WireMember, WireRegionStats};
use crate::persistence::coordinator::{
    next_epoch, ControlJournal, ControlStore, CoordinatorConfig, CoordinatorJournalError,
    RecoveredCoordinator, RecoveryStart,
};
use crate::persistence::DurableWake;
use crate::runtime::{RingReceiver, RingSender};
use crate::status::CoordinatorStatusView;
use crate::transport::{self, Fingerprint, FrameReader, Outbox, TransportError};

/// Everything the control executor starts with.
pub(crate) struct ControlInit {
    pub config: NodeConfig,
    pub uid: MemberUid,
    pub epoch: Instant,
    pub inbox: RingReceiver<ToControl>,
    pub to_cores: Vec<RingSender<ToCore>>,
    pub listener: std::net::TcpListener,
    pub shared: Arc<Shared>,
    pub scope: Arc<crate::persistence::DataScope>,
}

const TICK: Duration = Duration::from_millis(10);
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(2);
/// Most bytes queued for one control lane; beyond it frames are dropped
/// (membership and coordinator protocols retry).
const CONTROL_OUTBOX_MAX_BYTES: usize = 16 << 20;
/// Most messages kept per entity type for a coordinator whose recovery
/// read is under way (count; regions register again on their own).
const WAITING_MAX: usize = 4096;

enum LeavePhase {
    HandingOff { until: Duration },
    Leaving,
}

struct LeaveState {
    phase: LeavePhase,
    deadline: Duration,
    done: crossbeam_channel::Sender<()>,
}

struct Control {
    me: UniqueAddress,
    epoch: Instant,
    fp: Fingerprint,
    cluster: ClusterNode,
    types: BTreeSet<String>,
    /// The types that remember their entities (their coordinators allocate
    /// shards that lost their home again at once).
    remember: BTreeSet<String>,
    coordinators: HashMap<String, ShardCoordinator>,
    /// Each type's coordinator state, replicated from the coordinator to
    /// every member (its `Persist` effects), so the next one recovers it.
    coord_state: HashMap<String, CoordinatorState>,
    singleton: bool,
    peers: HashMap<String, Rc<Outbox>>,
    backoff: HashMap<String, (Duration, Duration)>,
    to_cores: Vec<RingSender<ToCore>>,
    registered: Vec<bool>,
    handed_off: Vec<bool>,
    leave: Option<LeaveState>,
    last_oldest: Option<UniqueAddress>,
    available: bool,
    stopped: bool,
    shutdown: bool,
    state: CurrentClusterState,
    subscribers_initialized: usize,
    shared: Arc<Shared>,
    /// Pending cluster-wide stats requests: id → (asker, expiry).
    stats_waiters: HashMap<u64, (crossbeam_channel::Sender<StatsEvent>, Duration)>,
    next_stats_id: u64,
    /// Coordinator admin commands forwarded to the oldest member: id →
    /// (asker, expiry).
    admin_waiters: HashMap<u64, (crossbeam_channel::Sender<AdminAnswer>, Duration)>,
    /// The control core's journal (the coordinators' events), if it opened.
    journal: Option<ControlStore>,
    /// Per type: messages for a coordinator whose recovery read is under
    /// way (handled once it started; at most [`WAITING_MAX`] each).
    waiting: HashMap<String, VecDeque<CoordinatorMsg>>,
    /// What the coordinator journal records and checks.
    journal_config: CoordinatorConfig,
    /// The `[coordinator]` table: rebalance and hand-off timing.
    coordinator_settings: crate::config::CoordinatorConfig,
    /// `[cluster] on_join_refused`: stop, or keep asking the seeds.
    on_join_refused: crate::config::OnJoinRefused,
    /// Per type: the coordinator's region messages held until the events
    /// persisted before them are durable: `(barrier LSN, to, msg)`.
    held: HashMap<String, VecDeque<(u64, RegionId, RegionMsg)>>,
    /// Per type: LSN of the coordinator's last appended event.
    barrier: HashMap<String, u64>,
    /// Woken by the journal's sync thread when held messages may go.
    durable_wake: Arc<DurableWake>,
    /// The highest LSN a durability callback is registered for.
    armed_lsn: u64,
    /// How each coordinator on this node recovered (status).
    coord_status: BTreeMap<String, CoordinatorStatusView>,
    /// The node's data scope: cluster id, journal identity.
    scope: Arc<crate::persistence::DataScope>,
}

type ControlRef = Rc<RefCell<Control>>;

/// Runs the control executor until [`ToControl::Shutdown`].
pub(crate) async fn run(init: ControlInit) {
    let me = UniqueAddress {
        address: Address(init.config.cluster_address.to_string()),
        uid: init.uid,
    };
    let seeds: Vec<Address> = init
        .config
        .seed_nodes
        .iter()
        .map(|s| Address(s.to_string()))
        .collect();
    // A node whose only seed is itself forms its cluster at once (Akka's
    // `joinSeedNodes(self)`), instead of waiting for other seeds.
    let alone = seeds.len() == 1 && seeds[0] == me.address;
    let mut cc = ClusterConfig::new(me.address.clone(), if alone { Vec::new() } else { seeds });
    cc.failure_detector.acceptable_heartbeat_pause =
        Duration::from_millis(init.config.heartbeat_pause_ms);
    cc.downing = DowningConfig::SplitBrainResolver(SbrConfig::with_stable_after(
        Duration::from_millis(init.config.downing_stable_after_ms),
    ));
    cc.refusals_to_down = init.config.cluster.refusals_to_down;
    cc.refusal_probe_interval =
        Duration::from_millis(init.config.cluster.refusal_probe_interval_ms);
    cc.random_seed = init.uid.0;
    let now = init.epoch.elapsed();
    let mut cluster = ClusterNode::new(cc, init.uid, now);
    cluster.subscribe();
    if alone {
        cluster.join(now, me.address.clone());
    }
    let n = init.to_cores.len();
    let listener = match monoio::net::TcpListener::from_std(init.listener) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(error = %e, "cannot adopt the cluster listener");
            return;
        }
    };
    let durable_wake = Arc::new(DurableWake::default());
    let journal = match crate::persistence::pg::PgSettings::from_config(&init.config.journal) {
        // The coordinators' state lives in the database (no I/O here: the
        // journal's own thread connects).
        Some(pg) => Some(ControlStore::Postgres(
            crate::persistence::pg_control::PgControlJournal::open(&pg, durable_wake.clone()),
        )),
        None => match ControlJournal::open(&init.config.data_dir, &init.config.durability) {
            Ok(mut j) => {
                j.set_scope(init.scope.clone());
                Some(ControlStore::Local(Box::new(j)))
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot open the control journal; coordinator state is kept in memory only");
                None
            }
        },
    };
    let journal_config = CoordinatorConfig {
        number_of_shards: init.config.number_of_shards,
        hash_name: SHARD_ID_HASH_NAME.to_string(),
    };
    let ctl = Rc::new(RefCell::new(Control {
        journal,
        waiting: HashMap::new(),
        journal_config,
        coordinator_settings: init.config.coordinator.clone(),
        on_join_refused: init.config.cluster.on_join_refused,
        held: HashMap::new(),
        barrier: HashMap::new(),
        durable_wake,
        armed_lsn: 0,
        coord_status: BTreeMap::new(),
        me,
        epoch: init.epoch,
        fp: super::fingerprint(&init.config, &init.scope),
        scope: init.scope,
        cluster,
        types: BTreeSet::new(),
        remember: BTreeSet::new(),
        coordinators: HashMap::new(),
        coord_state: HashMap::new(),
        singleton: false,
        peers: HashMap::new(),
        backoff: HashMap::new(),
        to_cores: init.to_cores,
        registered: vec![false; n],
        handed_off: vec![false; n],
        leave: None,
        last_oldest: None,
        available: false,
        stopped: false,
        shutdown: false,
        state: CurrentClusterState::default(),
        subscribers_initialized: 0,
        shared: init.shared,
        stats_waiters: HashMap::new(),
        next_stats_id: 0,
        admin_waiters: HashMap::new(),
    }));
    CTL_SELF.with(|c| *c.borrow_mut() = Some(ctl.clone()));
    ctl.borrow_mut().drive();
    let actl = ctl.clone();
    let stop_accept = crate::runtime::LocalNotify::default();
    let stop = stop_accept.clone();
    let accept = monoio::spawn(async move {
        while let Some(r) = crate::runtime::accept_or_stop(&listener, &stop).await {
            match r {
                Ok((s, _)) => {
                    transport::tune(&s);
                    monoio::spawn(inbound(actl.clone(), s));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cluster accept failed");
                    monoio::time::sleep(Duration::from_millis(10)).await;
                }
            }
            if actl.borrow().shutdown {
                break;
            }
        }
        drop(listener);
    });
    let dctl = ctl.clone();
    let wake = ctl.borrow().durable_wake.clone();
    monoio::spawn(async move {
        loop {
            wake.wait().await;
            if dctl.borrow().shutdown {
                return;
            }
            let mut c = dctl.borrow_mut();
            c.release_held();
            c.drive();
        }
    });
    let tctl = ctl.clone();
    monoio::spawn(async move {
        loop {
            monoio::time::sleep(TICK).await;
            if tctl.borrow().shutdown {
                return;
            }
            tctl.borrow_mut().tick();
        }
    });
    let mut inbox = init.inbox;
    let mut batch = Vec::with_capacity(256);
    loop {
        if !inbox.recv_batch(&mut batch, 256).await {
            break;
        }
        for m in batch.drain(..) {
            ctl.borrow_mut().on_inbox(m);
        }
        if ctl.borrow().shutdown {
            break;
        }
    }
    for p in ctl.borrow().peers.values() {
        p.close();
    }
    crate::runtime::stop_accepting(&stop_accept, accept).await;
}

thread_local! {
    static CTL_SELF: RefCell<Option<ControlRef>> = const { RefCell::new(None) };
}

impl Control {
    fn now(&self) -> Duration {
        self.epoch.elapsed()
    }

    fn to_all_cores(&self, f: impl Fn() -> ToCore) {
        for c in &self.to_cores {
            if c.send(f()).is_err() {
                tracing::warn!("core ring full or closed; control message dropped");
            }
        }
    }

    // ----- effects of the state machines -----

    /// Carries out every pending effect of the membership state machine and
    /// the coordinators (bounded: stops when a round produced nothing).
    fn drive(&mut self) {
        for _ in 0..64 {
            let mut progressed = false;
            let now = self.now();
            self.ensure_cluster_id();
            if let Some(reason) = self.cluster.poll_stop() {
                progressed = true;
                self.on_stop(reason);
            }
            while let Some(cmd) = self.cluster.poll_singleton() {
                progressed = true;
                match cmd {
                    SingletonCommand::Start => self.start_coordinators(),
                    SingletonCommand::Stop => {
                        self.stop_coordinators();
                        self.cluster.handle_singleton_stopped(now);
                    }
                }
            }
            while let Some(t) = self.cluster.poll_transmit() {
                progressed = true;
                let bytes = cl::encode(&t.message);
                self.send_control(&t.to.0, &ControlFrame::Cluster { bytes });
            }
            while let Some(e) = self.cluster.poll_event() {
                progressed = true;
                self.on_cluster_event(e);
            }
            let types: Vec<String> = self.coordinators.keys().cloned().collect();
            for t in types {
                progressed |= self.drain_coordinator(&t);
            }
            if !progressed {
                break;
            }
        }
        let oldest = self.cluster.oldest();
        if oldest != self.last_oldest {
            tracing::info!(oldest = ?oldest.as_ref().map(|o| o.to_string()), "coordinator location changed");
            self.last_oldest = oldest;
            self.to_all_cores(|| ToCore::CoordinatorMoved);
        }
        let avail = self.cluster.is_available();
        if avail != self.available {
            self.available = avail;
            self.to_all_cores(|| ToCore::Available(avail));
        }
        let up = self
            .cluster
            .self_member()
            .is_some_and(|m| m.status == cl::MemberStatus::Up);
        let ready = up && self.registered.iter().all(|r| *r) && !self.stopped;
        self.shared.ready.store(ready, Ordering::Release);
    }

    fn is_up(&self) -> bool {
        self.cluster
            .self_member()
            .is_some_and(|m| m.status == cl::MemberStatus::Up)
    }

    /// The oldest Up member establishes the cluster's id when nobody told
    /// it one (it formed the cluster): the id its data records, else a new
    /// one; every member is told it on its control lane.
    fn ensure_cluster_id(&mut self) {
        if self.stopped || self.scope.cluster_id().is_some() || !self.is_up() {
            return;
        }
        if self.cluster.oldest().as_ref() != Some(&self.me) {
            return;
        }
        match self.scope.establish_cluster_id() {
            Ok(id) => tracing::info!(cluster_id = id, "cluster id established"),
            Err(e) => tracing::error!(error = %e, "cannot record the cluster id"),
        }
        self.broadcast_identity();
    }

    /// Sends this node's cluster id on every control lane.
    fn broadcast_identity(&mut self) {
        let Some(cluster_id) = self.scope.cluster_id() else {
            return;
        };
        let f = ControlFrame::Identity { cluster_id };
        let peers: Vec<String> = self.peers.keys().cloned().collect();
        for p in peers {
            self.send_control(&p, &f);
        }
    }

    /// Learns the cluster id `id` from `from` (a handshake or an
    /// `Identity` frame).
    fn learn_cluster_id(&mut self, id: &str, from: &str) {
        use crate::persistence::identity::Learned;
        if id.is_empty() {
            return;
        }
        match self.scope.learn_cluster_id(id, from) {
            Ok(Learned::Same) => {}
            Ok(Learned::Adopted) => {
                tracing::info!(cluster_id = id, from, "cluster id learned");
                self.broadcast_identity();
            }
            Ok(Learned::Conflict { reason, mine }) => {
                if mine {
                    self.refuse_to_join(reason);
                } else {
                    tracing::error!(peer = from, reason, "member of another cluster");
                }
            }
            Err(e) => tracing::error!(error = %e, "cannot record the cluster id"),
        }
    }

    /// Stops the node instead of joining when it is not a member yet (the
    /// cluster it reached is not its own, or shares no journal with it);
    /// a member that is Up only logs the reason.
    fn refuse_to_join(&mut self, reason: String) {
        if self.stopped {
            return;
        }
        if self.is_up() {
            tracing::error!(reason, "refused by a member");
            return;
        }
        tracing::error!(reason, "refusing to join the cluster; stopping");
        if let Ok(mut g) = self.shared.refusal.lock() {
            *g = Some(reason);
        }
        self.stopped = true;
        self.stop_coordinators();
        self.to_all_cores(|| ToCore::Stop);
        self.shared.stopped.store(4, Ordering::Release);
        if let Some(l) = self.leave.take() {
            let _ = l.done.try_send(());
        }
    }

    fn on_stop(&mut self, reason: StopReason) {
        self.stopped = true;
        let code = match reason {
            StopReason::Left => 1,
            _ => 2,
        };
        match reason {
            StopReason::Left => tracing::info!("left the cluster"),
            _ => tracing::error!(?reason, "this member was downed; stopping"),
        }
        self.stop_coordinators();
        self.to_all_cores(|| ToCore::Stop);
        self.shared.stopped.store(code, Ordering::Release);
        if let Some(l) = self.leave.take() {
            let _ = l.done.try_send(());
        }
    }

    fn on_cluster_event(&mut self, e: ClusterEvent) {
        self.state.apply(&e);
        tracing::info!(event = ?short_event(&e), "cluster event");
        // Subscribers get their own snapshot when they subscribe (see
        // `ToControl::Subscribe`), then every change.
        if !matches!(e, ClusterEvent::CurrentClusterState(_)) {
            if let Ok(mut subs) = self.shared.subscribers.lock() {
                subs.retain(|s| s.try_send(e.clone()).is_ok() || !s.is_full());
            }
        }
        if let ClusterEvent::MemberUp(m) = &e {
            if self.singleton && m.unique_address != self.me {
                let addr = m.unique_address.address.0.clone();
                self.send_coordinator_snapshot(&addr);
            }
        }
        if let Some(me) = sharding_event(&e) {
            let now = self.now();
            for c in self.coordinators.values_mut() {
                c.handle_membership(now, me.clone());
            }
            self.to_all_cores(|| ToCore::Membership(me.clone()));
        }
    }

    fn current_members(&self) -> MembershipEvent {
        let list = self
            .state
            .members
            .values()
            .filter_map(|m| match m.status {
                cl::MemberStatus::Up => Some((m.unique_address.clone(), ShMemberStatus::Up)),
                cl::MemberStatus::Leaving | cl::MemberStatus::Exiting => {
                    Some((m.unique_address.clone(), ShMemberStatus::Leaving))
                }
                _ => None,
            })
            .collect();
        MembershipEvent::CurrentMembers(list)
    }

    /// Starts `t`'s coordinator here: recovers its state (the newest
    /// control journal of the data root, or the database, read on its own
    /// thread: the coordinator starts in [`Self::poll_journal`] then; else
    /// the copy replicated to this member; else empty), begins a new journal incarnation with a writer
    /// epoch above every recorded one, then reconciles with the membership
    /// (regions of members that are gone are terminated at once; the others
    /// must register again within the re-register timeout).
    fn new_coordinator(&mut self, t: &str) {
        let Some(j) = self.journal.as_mut() else {
            self.start_coordinator(t, None);
            return;
        };
        match j.recover_start(t, &self.journal_config) {
            RecoveryStart::Ready(r) => self.start_coordinator(t, Some(*r)),
            RecoveryStart::Pending => {
                // The database's thread reads; the coordinator starts when
                // it finished (`poll_journal`), never before.
                tracing::info!(type_name = t, "coordinator recovering from the database");
                self.waiting.entry(t.to_string()).or_default();
                self.coord_status.insert(
                    t.to_string(),
                    CoordinatorStatusView {
                        type_name: t.to_string(),
                        writer_epoch: 0,
                        recovered_from: "recovering".to_string(),
                        journal_dir: None,
                        recovered_records: 0,
                        recovered_shards: 0,
                        shards: 0,
                        refused: None,
                        journal_error: None,
                    },
                );
            }
        }
    }

    /// Outcomes of the database journal: finished recoveries start their
    /// coordinators (with the messages that waited for them); refused
    /// appends stop theirs.
    fn poll_journal(&mut self) {
        let Some(j) = self.journal.as_mut() else {
            return;
        };
        let recovered = j.take_recovered();
        self.fail_refused();
        for (t, r) in recovered {
            self.start_coordinator(&t, Some(r));
            let msgs = self.waiting.remove(&t).unwrap_or_default();
            if !msgs.is_empty() && self.coordinators.contains_key(&t) {
                let now = self.now();
                if let Some(c) = self.coordinators.get_mut(&t) {
                    for m in msgs {
                        c.handle_message(now, m);
                    }
                }
                self.drain_coordinator(&t);
            }
        }
    }

    /// Stops the coordinators whose appends the database refused; whether
    /// there were any.
    fn fail_refused(&mut self) -> bool {
        let Some(j) = self.journal.as_mut() else {
            return false;
        };
        let refused = j.take_refused();
        let any = !refused.is_empty();
        for (t, why) in refused {
            self.fail_coordinator(&t, why);
        }
        any
    }

    /// Keeps `msg` for `t`'s coordinator when its recovery is under way;
    /// false: there is none to wait for.
    fn keep_for_recovering(&mut self, t: &str, msg: CoordinatorMsg) -> bool {
        let Some(q) = self.waiting.get_mut(t) else {
            return false;
        };
        if q.len() >= WAITING_MAX {
            // Regions register again on their own; the oldest goes.
            q.pop_front();
        }
        q.push_back(msg);
        true
    }

    /// Starts `t`'s coordinator from its journal's recovery `rec` (`None`:
    /// no journal).
    fn start_coordinator(
        &mut self,
        t: &str,
        rec: Option<Result<RecoveredCoordinator, CoordinatorJournalError>>,
    ) {
        let now = self.now();
        // Generations are the journal's writer epochs: floor them at the wall
        // clock so a cluster whose coordinator journals are gone never reuses
        // an epoch below the ones its durable entities already wrote with.
        let wall_clock_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        let mut status = CoordinatorStatusView {
            type_name: t.to_string(),
            writer_epoch: 0,
            recovered_from: "empty".to_string(),
            journal_dir: None,
            recovered_records: 0,
            recovered_shards: 0,
            shards: 0,
            refused: None,
            journal_error: None,
        };
        let replicated = self.coord_state.get(t).cloned();
        let mut state = CoordinatorState::default();
        if let (Some(j), Some(rec)) = (self.journal.as_mut(), rec) {
            let rec = match rec {
                Ok(r) => r,
                Err(e) => {
                    tracing::error!(type_name = t, error = %e, "coordinator refused to start");
                    status.refused = Some(e.to_string());
                    self.coord_status.insert(t.to_string(), status);
                    return;
                }
            };
            if let Some(dir) = &rec.source {
                status.recovered_from = if rec.from_database {
                    "database".to_string()
                } else {
                    "journal".to_string()
                };
                status.journal_dir = Some(dir.display().to_string());
                status.recovered_records = rec.records;
                state = rec.state;
            } else if let Some(r) = replicated {
                status.recovered_from = "replicated".to_string();
                state = r;
            }
            let epoch = rec
                .claimed_epoch
                .unwrap_or_else(|| next_epoch(rec.highest_epoch, wall_clock_ms));
            match j.begin(t, epoch, &state, &self.journal_config) {
                Ok(lsn) => {
                    self.barrier.insert(t.to_string(), lsn.0);
                }
                Err(e) => {
                    tracing::error!(type_name = t, error = %e, "coordinator refused to start");
                    status.refused = Some(e.to_string());
                    self.coord_status.insert(t.to_string(), status);
                    return;
                }
            }
            status.writer_epoch = epoch.0;
        } else if let Some(r) = replicated {
            status.recovered_from = "replicated".to_string();
            state = r;
        }
        status.recovered_shards = state.shards.len() as u64;
        tracing::info!(
            type_name = t,
            writer_epoch = status.writer_epoch,
            from = %status.recovered_from,
            dir = status.journal_dir.as_deref().unwrap_or("-"),
            records = status.recovered_records,
            shards = status.recovered_shards,
            "coordinator recovered"
        );
        // Members' replicated copies follow the recovered state.
        self.coord_state.insert(t.to_string(), state.clone());
        let cc = &self.coordinator_settings;
        let settings = CoordinatorSettings {
            min_generation: Generation(wall_clock_ms),
            remember_entities: self.remember.contains(t),
            rebalance_interval: cc.rebalance_interval(),
            handoff_timeout: cc.handoff_timeout(),
            reregister_timeout: cc.reregister_timeout(),
            ..CoordinatorSettings::default()
        };
        let strategy = LeastShardAllocationStrategy {
            rebalance_absolute_limit: cc.rebalance_absolute_limit,
            rebalance_relative_limit: cc.rebalance_relative_limit,
        };
        let mut c = ShardCoordinator::recover_state(settings, Box::new(strategy), state, now);
        c.handle_membership(now, self.current_members());
        self.coordinators.insert(t.to_string(), c);
        self.coord_status.insert(t.to_string(), status);
        for addr in self.other_members() {
            self.send_coordinator_snapshot(&addr);
        }
    }

    /// Stops `t`'s coordinator after its journal refused an append (a newer
    /// incarnation fenced it, or the journal failed).
    fn fail_coordinator(&mut self, t: &str, reason: String) {
        tracing::error!(
            type_name = t,
            reason,
            "coordinator stops: its journal refused an event"
        );
        self.coordinators.remove(t);
        self.held.remove(t);
        self.barrier.remove(t);
        if let Some(j) = self.journal.as_mut() {
            j.end(t);
        }
        if let Some(st) = self.coord_status.get_mut(t) {
            st.refused = Some(reason);
        }
    }

    /// Sends the held region messages whose events are now durable.
    fn release_held(&mut self) {
        // Read before the refusals are taken: the database journal records
        // a refusal before the durable LSN moves past it.
        let durable = self
            .journal
            .as_ref()
            .map_or(u64::MAX, |j| j.durable_lsn().0);
        self.poll_journal();
        let types: Vec<String> = self.held.keys().cloned().collect();
        for t in types {
            let ready: Vec<(RegionId, RegionMsg)> = match self.held.get_mut(&t) {
                Some(q) => {
                    let n = q.iter().take_while(|(b, _, _)| *b <= durable).count();
                    q.drain(..n).map(|(_, to, msg)| (to, msg)).collect()
                }
                None => Vec::new(),
            };
            for (to, msg) in ready {
                self.send_region(&t, to, msg);
            }
        }
        self.held.retain(|_, q| !q.is_empty());
        self.arm_durable();
    }

    /// Registers a durability callback for the newest held message.
    fn arm_durable(&mut self) {
        let Some(j) = &self.journal else { return };
        let want = self
            .held
            .values()
            .filter_map(|q| q.back().map(|(b, _, _)| *b))
            .max()
            .unwrap_or(0);
        if want == 0 || want <= self.armed_lsn {
            return;
        }
        self.armed_lsn = want;
        j.notify_when_durable(shardline_journal::Lsn(want), self.durable_wake.clone());
    }

    fn start_coordinators(&mut self) {
        self.ensure_cluster_id();
        tracing::info!("coordinator singleton starts here");
        self.singleton = true;
        let types: Vec<String> = self.types.iter().cloned().collect();
        for t in types {
            self.new_coordinator(&t);
        }
        // Regions (here and elsewhere) register again with the new coordinator.
        self.to_all_cores(|| ToCore::CoordinatorMoved);
    }

    fn stop_coordinators(&mut self) {
        if self.singleton {
            tracing::info!("coordinator singleton stops here");
        }
        self.singleton = false;
        if let Some(j) = self.journal.as_mut() {
            for t in self.coordinators.keys() {
                j.end(t);
            }
        }
        if let Some(j) = self.journal.as_mut() {
            for t in self.waiting.keys() {
                j.end(t);
            }
        }
        self.waiting.clear();
        self.coordinators.clear();
        self.held.clear();
        self.barrier.clear();
        self.coord_status.clear();
    }

    /// Carries out `t`'s coordinator effects: events are appended to the
    /// control journal (never waiting for a flush) and replicated to the
    /// other members; a region message waits until every event before it
    /// is durable (the durability watcher wakes [`Self::release_held`]).
    fn drain_coordinator(&mut self, t: &str) -> bool {
        let mut any = false;
        loop {
            let Some(c) = self.coordinators.get_mut(t) else {
                return any;
            };
            let Some(e) = c.poll_effect() else {
                self.after_drain(t);
                return any;
            };
            any = true;
            match e {
                CoordinatorEffect::Send { to, msg } => {
                    let barrier = self.barrier.get(t).copied().unwrap_or(0);
                    let durable = self
                        .journal
                        .as_ref()
                        .map_or(u64::MAX, |j| j.durable_lsn().0);
                    // The database journal's LSN also passes refused
                    // appends: a refused coordinator sends nothing more.
                    if self.fail_refused() && !self.coordinators.contains_key(t) {
                        return true;
                    }
                    let q = self.held.entry(t.to_string()).or_default();
                    if q.is_empty() && barrier <= durable {
                        self.send_region(t, to, msg);
                    } else {
                        q.push_back((barrier, to, msg));
                    }
                }
                CoordinatorEffect::Persist(ev) => {
                    if let Some(j) = self.journal.as_mut() {
                        if let Some(epoch) = j.epoch(t) {
                            match j.append(t, epoch, &ev) {
                                Ok(lsn) => {
                                    self.barrier.insert(t.to_string(), lsn.0);
                                }
                                Err(e) => {
                                    self.fail_coordinator(t, e.to_string());
                                    return true;
                                }
                            }
                        }
                    }
                    // "Durable" here means: applied to this member's copy and
                    // queued to every other member's control lane before any
                    // later effect (FIFO lanes keep that order per member).
                    self.coord_state
                        .entry(t.to_string())
                        .or_default()
                        .apply(&ev);
                    let f = ControlFrame::CoordinatorEvents {
                        type_name: t.to_string(),
                        reset: false,
                        events: vec![(&ev).into()],
                    };
                    for addr in self.other_members() {
                        self.send_control(&addr, &f);
                    }
                }
            }
        }
    }

    /// After a drained turn of `t`'s coordinator: a snapshot when due, and
    /// a durability callback for held messages.
    fn after_drain(&mut self, t: &str) {
        let due = self.journal.as_ref().is_some_and(|j| j.snapshot_due(t));
        if due {
            if let (Some(j), Some(c)) = (self.journal.as_mut(), self.coordinators.get(t)) {
                if let Err(e) = j.save_snapshot(t, c.state(), &self.journal_config) {
                    tracing::warn!(type_name = t, error = %e, "coordinator snapshot failed");
                }
            }
        }
        if self.held.get(t).is_some_and(|q| !q.is_empty()) {
            self.arm_durable();
        }
    }

    /// Cluster addresses of the other members that are alive.
    fn other_members(&self) -> Vec<String> {
        self.state
            .members
            .values()
            .filter(|m| {
                m.unique_address != self.me
                    && !matches!(m.status, cl::MemberStatus::Down | cl::MemberStatus::Removed)
            })
            .map(|m| m.unique_address.address.0.clone())
            .collect()
    }

    /// Sends this member's copy of every coordinator state to `addr`.
    fn send_coordinator_snapshot(&mut self, addr: &str) {
        let frames: Vec<ControlFrame> = self
            .coord_state
            .iter()
            .map(|(t, st)| ControlFrame::CoordinatorEvents {
                type_name: t.clone(),
                reset: true,
                events: snapshot_events(st).iter().map(Into::into).collect(),
            })
            .collect();
        for f in frames {
            self.send_control(addr, &f);
        }
    }

    fn send_region(&mut self, t: &str, to: RegionId, msg: RegionMsg) {
        if to.member == self.me {
            if let Some(c) = self.to_cores.get(usize::from(to.core)) {
                let _ = c.send(ToCore::Region {
                    type_name: t.to_string(),
                    msg,
                });
            }
        } else {
            let addr = to.member.address.0.clone();
            let f = ControlFrame::ToRegion {
                type_name: t.to_string(),
                to: (&to).into(),
                msg: (&msg).into(),
            };
            self.send_control(&addr, &f);
        }
    }

    fn route_to_coordinator(&mut self, t: &str, msg: CoordinatorMsg) {
        if self.singleton {
            let now = self.now();
            if let Some(c) = self.coordinators.get_mut(t) {
                c.handle_message(now, msg);
                self.drain_coordinator(t);
            } else {
                self.keep_for_recovering(t, msg);
            }
            return;
        }
        match self.cluster.oldest() {
            Some(o) if o != self.me => {
                let f = ControlFrame::ToCoordinator {
                    type_name: t.to_string(),
                    msg: (&msg).into(),
                };
                self.send_control(&o.address.0.clone(), &f);
            }
            // No coordinator yet (or it is starting here): the region retries.
            _ => {}
        }
    }

    // ----- control lanes -----

    fn send_control(&mut self, addr: &str, frame: &ControlFrame) {
        if addr == self.me.address.0 {
            return;
        }
        let now = self.now();
        if !self.peers.contains_key(addr) {
            if let Some((until, _)) = self.backoff.get(addr) {
                if now < *until {
                    return;
                }
            }
            let outbox = Rc::new(Outbox::default());
            self.peers.insert(addr.to_string(), outbox.clone());
            if let Some(me) = CTL_SELF.with(|c| c.borrow().clone()) {
                monoio::spawn(run_peer(me, addr.to_string(), outbox));
            }
        }
        let Some(o) = self.peers.get(addr) else {
            return;
        };
        if o.buf.borrow().len() > CONTROL_OUTBOX_MAX_BYTES {
            tracing::warn!(peer = addr, "control lane backlog full; frame dropped");
            return;
        }
        if let Err(e) = encode_frame(frame, &mut o.buf.borrow_mut()) {
            tracing::warn!(error = %e, "cannot encode control frame");
        }
        o.flush();
    }

    /// A control lane ended (`refused`: its connect was refused). The next
    /// connect waits a backoff that doubles up to `BACKOFF_MAX`, except
    /// after a refusal: a refused connect costs nothing, and the membership
    /// state machine's probes must reach the socket to learn whether the
    /// port still refuses.
    fn peer_failed(&mut self, addr: &str, outbox: &Rc<Outbox>, refused: bool) {
        if self.peers.get(addr).is_some_and(|o| Rc::ptr_eq(o, outbox)) {
            self.peers.remove(addr);
        }
        let now = self.now();
        let step = if refused {
            BACKOFF_MIN
        } else {
            self.backoff
                .get(addr)
                .map(|(_, s)| (*s * 2).min(BACKOFF_MAX))
                .unwrap_or(BACKOFF_MIN)
        };
        self.backoff.insert(addr.to_string(), (now + step, step));
    }

    /// The connect to `addr` was refused (ECONNREFUSED or a reset): the
    /// membership state machine decides what that means.
    fn peer_connection_refused(&mut self, addr: &str) {
        if self.stopped {
            return;
        }
        let now = self.now();
        tracing::debug!(peer = addr, "cluster port refused the connection");
        self.cluster
            .handle_connection_refused(now, &Address(addr.to_string()));
        self.drive();
    }

    /// An established control lane to `addr` was closed by the peer.
    fn peer_connection_lost(&mut self, addr: &str) {
        if self.stopped {
            return;
        }
        let now = self.now();
        self.cluster
            .handle_connection_lost(now, &Address(addr.to_string()));
        self.drive();
    }

    /// A peer refused this node at the handshake: when it is a seed and
    /// this node is not a member yet, this node will not form a cluster of
    /// its own (see `ClusterNode::handle_seed_refused`).
    fn peer_refused(&mut self, addr: &str, reason: &str) {
        let now = self.now();
        let seed = Address(addr.to_string());
        let before = self.cluster.join_refused().map(str::to_string);
        self.cluster.handle_seed_refused(now, &seed, reason);
        let after = self.cluster.join_refused().map(str::to_string);
        if after.is_some() && after != before {
            if self.stopped {
                // Already stopping (an earlier seed's refusal).
            } else if self.on_join_refused == crate::config::OnJoinRefused::Exit {
                tracing::error!(
                    seed = addr,
                    reason,
                    "refused by a seed node; stopping (cluster.on_join_refused = \"exit\")"
                );
                self.refuse_to_join(format!("refused by seed node {addr}: {reason}"));
            } else {
                tracing::error!(
                    seed = addr,
                    reason,
                    "refused by a seed node; this node will not form a cluster of its own and keeps asking the seeds"
                );
            }
        }
    }

    fn peer_connected(&mut self, addr: &str) {
        self.backoff.remove(addr);
    }

    fn on_control_frame(&mut self, body: &[u8]) -> Result<(), FrameError> {
        let f: ControlFrame = decode_frame_body(body)?;
        let now = self.now();
        match f {
            ControlFrame::Cluster { bytes } => {
                let m = cl::decode(&bytes).map_err(|e| FrameError::Invalid(e.to_string()))?;
                self.cluster.handle_message(now, m);
            }
            ControlFrame::ToCoordinator { type_name, msg } => {
                if self.singleton {
                    if let Some(c) = self.coordinators.get_mut(&type_name) {
                        c.handle_message(now, msg.into());
                    } else {
                        self.keep_for_recovering(&type_name, msg.into());
                    }
                }
            }
            ControlFrame::CoordinatorEvents {
                type_name,
                reset,
                events,
            } => {
                let st = self.coord_state.entry(type_name).or_default();
                if reset {
                    *st = CoordinatorState::default();
                }
                for e in events {
                    st.apply(&CoordinatorEvent::from(e));
                }
            }
            ControlFrame::ToRegion { type_name, to, msg } => {
                let to: RegionId = to.into();
                if to.member == self.me {
                    let msg: RegionMsg = msg.try_into()?;
                    if let Some(c) = self.to_cores.get(usize::from(to.core)) {
                        let _ = c.send(ToCore::Region { type_name, msg });
                    }
                }
            }
            ControlFrame::StatsRequest {
                id,
                type_name,
                reply_to,
            } => self.answer_stats(id, type_name, reply_to),
            ControlFrame::Identity { cluster_id } => self.learn_cluster_id(&cluster_id, "a member"),
            ControlFrame::StatsReply {
                id,
                member,
                regions,
            } => {
                if let Some((tx, _)) = self.stats_waiters.get(&id) {
                    let _ = tx.send(StatsEvent::Answer(member_stats(member, regions)));
                }
            }
            ControlFrame::CoordinatorAdminRequest {
                id,
                rebalance,
                type_name,
                reply_to,
            } => {
                let cmd = if rebalance {
                    CoordinatorCommand::Rebalance { type_name }
                } else {
                    CoordinatorCommand::Allocation
                };
                let (status, body) = match self.admin_here(&cmd) {
                    Ok(json) => (crate::envelope::Status::Ok as u8, json),
                    Err((st, why)) => (st as u8, why.into_bytes()),
                };
                let f = ControlFrame::CoordinatorAdminReply { id, status, body };
                self.send_control(&reply_to, &f);
            }
            ControlFrame::CoordinatorAdminReply { id, status, body } => {
                if let Some((tx, _)) = self.admin_waiters.remove(&id) {
                    let answer = match crate::envelope::Status::from_u8(status) {
                        Some(crate::envelope::Status::Ok) => Ok(body),
                        st => Err((
                            st.unwrap_or(crate::envelope::Status::EntityFailed),
                            String::from_utf8_lossy(&body).into_owned(),
                        )),
                    };
                    let _ = tx.send(answer);
                }
            }
        }
        self.drive();
        Ok(())
    }

    // ----- timers and inbox -----

    fn tick(&mut self) {
        self.release_held();
        let now = self.now();
        if !self.stopped && self.cluster.poll_timeout().is_some_and(|t| t <= now) {
            self.cluster.handle_timeout(now);
        }
        let due: Vec<String> = self
            .coordinators
            .iter()
            .filter(|(_, c)| c.poll_timeout().is_some_and(|t| t <= now))
            .map(|(t, _)| t.clone())
            .collect();
        for t in due {
            if let Some(c) = self.coordinators.get_mut(&t) {
                c.handle_timeout(now);
                for a in c.take_abandoned_hand_offs() {
                    tracing::warn!(
                        type_name = t,
                        shard = a.shard.0,
                        owner = %a.owner,
                        generation = a.generation.0,
                        reason = a.reason,
                        "hand-off abandoned; the shard stays with its owner"
                    );
                }
            }
        }
        if let Some(l) = &self.leave {
            if let LeavePhase::HandingOff { until } = l.phase {
                if now >= until {
                    tracing::warn!("hand-off did not finish in time; leaving anyway");
                    self.begin_leave();
                }
            }
        }
        self.stats_waiters.retain(|_, (_, until)| now < *until);
        let expired: Vec<u64> = self
            .admin_waiters
            .iter()
            .filter(|(_, (_, until))| now >= *until)
            .map(|(id, _)| *id)
            .collect();
        for id in expired {
            if let Some((tx, _)) = self.admin_waiters.remove(&id) {
                let oldest = self.cluster.oldest().map(|o| o.address.0);
                let _ = tx.send(Err((
                    crate::envelope::Status::Unavailable,
                    format!(
                        "the coordinator's member {} did not answer within {} ms",
                        oldest.as_deref().unwrap_or("(none)"),
                        super::admin::FORWARD_TIMEOUT.as_millis()
                    ),
                )));
            }
        }
        if self.leave.as_ref().is_some_and(|l| now >= l.deadline) {
            if let Some(l) = self.leave.take() {
                tracing::warn!("leave did not complete in time");
                let _ = l.done.try_send(());
            }
        }
        self.drive();
    }

    fn begin_leave(&mut self) {
        let now = self.now();
        if let Some(l) = &mut self.leave {
            l.phase = LeavePhase::Leaving;
        }
        tracing::info!("shards handed off; leaving the cluster");
        self.cluster.leave(now);
    }

    fn on_inbox(&mut self, m: ToControl) {
        match m {
            ToControl::ToCoordinator { type_name, msg } => {
                self.route_to_coordinator(&type_name, msg)
            }
            ToControl::ToRegion { type_name, to, msg } => self.send_region(&type_name, to, msg),
            ToControl::RegisterType {
                type_name,
                remember_entities,
            } => {
                if remember_entities {
                    self.remember.insert(type_name.clone());
                }
                if self.types.insert(type_name.clone()) && self.singleton {
                    self.new_coordinator(&type_name);
                }
            }
            ToControl::Registered { core, all } => {
                if let Some(r) = self.registered.get_mut(usize::from(core)) {
                    *r = all;
                }
            }
            ToControl::ShutdownComplete { core } => {
                if let Some(r) = self.handed_off.get_mut(usize::from(core)) {
                    *r = true;
                }
                let all = self.handed_off.iter().all(|d| *d);
                let handing = self
                    .leave
                    .as_ref()
                    .is_some_and(|l| matches!(l.phase, LeavePhase::HandingOff { .. }));
                if all && handing {
                    self.begin_leave();
                }
            }
            ToControl::Status { reply } => {
                let _ = reply.send(self.view());
            }
            ToControl::ShardingStats {
                type_name,
                wait,
                reply,
            } => self.ask_stats(type_name, wait, reply),
            ToControl::CoordinatorAdmin { cmd, reply } => self.coordinator_admin(cmd, reply),
            ToControl::Subscribe => {
                if let Ok(subs) = self.shared.subscribers.lock() {
                    let snapshot = ClusterEvent::CurrentClusterState(self.state.clone());
                    for s in subs.iter().skip(self.subscribers_initialized) {
                        let _ = s.try_send(snapshot.clone());
                    }
                    self.subscribers_initialized = subs.len();
                }
            }
            ToControl::Leave { timeout, done } => {
                let now = self.now();
                if self.stopped {
                    let _ = done.try_send(());
                    return;
                }
                tracing::info!("graceful leave: handing off shards");
                self.leave = Some(LeaveState {
                    phase: LeavePhase::HandingOff {
                        until: now + timeout / 2,
                    },
                    deadline: now + timeout,
                    done,
                });
                self.handed_off.iter_mut().for_each(|d| *d = false);
                self.to_all_cores(|| ToCore::GracefulShutdown);
            }
            ToControl::Shutdown => self.shutdown = true,
        }
        self.drive();
    }

    // ----- coordinator admin commands -----

    /// Answers `cmd` from the coordinators on this member, or says where
    /// they run.
    fn admin_here(&mut self, cmd: &CoordinatorCommand) -> AdminAnswer {
        if !self.singleton {
            let where_ = match self.cluster.oldest() {
                Some(o) => format!("they run on {}", o.address.0),
                None => "no member is Up".to_string(),
            };
            return Err((
                crate::envelope::Status::Unavailable,
                format!(
                    "the coordinators do not run on {}: {where_}",
                    self.me.address.0
                ),
            ));
        }
        let now = self.now();
        let me = self.me.clone();
        super::admin::answer(&me, now, &mut self.coordinators, cmd)
    }

    /// A coordinator admin command: answered here when the coordinators
    /// run here, else forwarded to the oldest member (answered
    /// `Unavailable` when there is none, or after
    /// [`super::admin::FORWARD_TIMEOUT`] without its answer).
    fn coordinator_admin(
        &mut self,
        cmd: CoordinatorCommand,
        reply: crossbeam_channel::Sender<AdminAnswer>,
    ) {
        let oldest = self.cluster.oldest();
        match oldest {
            Some(o) if !self.singleton && o != self.me => {
                let now = self.now();
                self.next_stats_id += 1;
                let id = self.next_stats_id;
                self.admin_waiters
                    .insert(id, (reply, now + super::admin::FORWARD_TIMEOUT));
                let (rebalance, type_name) = match cmd {
                    CoordinatorCommand::Allocation => (false, None),
                    CoordinatorCommand::Rebalance { type_name } => (true, type_name),
                };
                let f = ControlFrame::CoordinatorAdminRequest {
                    id,
                    rebalance,
                    type_name,
                    reply_to: self.me.address.0.clone(),
                };
                self.send_control(&o.address.0, &f);
            }
            _ => {
                let _ = reply.send(self.admin_here(&cmd));
            }
        }
    }

    // ----- cluster-wide sharding stats -----

    /// Sends a stats request for `type_name` to every other Up member that
    /// is reachable; reports who was asked, then forwards their answers
    /// for `wait`.
    fn ask_stats(
        &mut self,
        type_name: String,
        wait: Duration,
        reply: crossbeam_channel::Sender<StatsEvent>,
    ) {
        let now = self.now();
        let unreachable_set = &self.cluster.current_state().unreachable;
        let mut asked = Vec::new();
        let mut unreachable = Vec::new();
        for m in self.cluster.gossip().members.values() {
            if m.status != cl::MemberStatus::Up || m.unique_address == self.me {
                continue;
            }
            let who = (m.unique_address.address.0.clone(), m.unique_address.uid.0);
            if unreachable_set.contains(&m.unique_address) {
                unreachable.push(who);
            } else {
                asked.push(who);
            }
        }
        self.next_stats_id += 1;
        let id = self.next_stats_id;
        if !asked.is_empty() {
            self.stats_waiters.insert(id, (reply.clone(), now + wait));
        }
        let frame = ControlFrame::StatsRequest {
            id,
            type_name,
            reply_to: self.me.address.0.clone(),
        };
        for (addr, _) in &asked {
            self.send_control(addr, &frame);
        }
        let _ = reply.send(StatsEvent::Asked { asked, unreachable });
    }

    /// Collects this node's regions of `type_name` from every data core and
    /// answers `reply_to` on its control lane (from a spawned task).
    fn answer_stats(&mut self, id: u64, type_name: String, reply_to: String) {
        let (tx, rx) = crossbeam_channel::bounded(self.to_cores.len().max(1));
        let cores = self
            .to_cores
            .iter()
            .filter(|c| c.send(ToCore::Status { reply: tx.clone() }).is_ok())
            .count();
        let member = WireMember {
            address: self.me.address.0.clone(),
            uid: self.me.uid.0,
        };
        let Some(ctl) = CTL_SELF.with(|c| c.borrow().clone()) else {
            return;
        };
        monoio::spawn(async move {
            let deadline = Instant::now() + STATS_CORE_WAIT;
            let mut regions = Vec::new();
            let mut got = 0;
            while got < cores && Instant::now() < deadline {
                while let Ok(rs) = rx.try_recv() {
                    got += 1;
                    regions.extend(
                        rs.into_iter()
                            .filter(|r| r.type_name == type_name)
                            .map(|r| {
                                let st = crate::status::RegionShardStats::of(&r);
                                WireRegionStats {
                                    core: st.core,
                                    proxy: st.proxy,
                                    registered: st.registered,
                                    shards: st.shards.into_iter().collect(),
                                    buffered: st.buffered,
                                    dead_letters: st.dead_letters,
                                }
                            }),
                    );
                }
                if got < cores {
                    monoio::time::sleep(Duration::from_millis(1)).await;
                }
            }
            regions.sort_by_key(|r| r.core);
            let frame = ControlFrame::StatsReply {
                id,
                member,
                regions,
            };
            ctl.borrow_mut().send_control(&reply_to, &frame);
        });
    }

    fn view(&self) -> ClusterView {
        let st = self.cluster.current_state();
        let g = self.cluster.gossip();
        let mut members: Vec<MemberStatusView> = g
            .members
            .values()
            .map(|m| MemberStatusView {
                address: m.unique_address.address.0.clone(),
                uid: m.unique_address.uid.0,
                status: format!("{:?}", m.status),
                reachable: !st.unreachable.contains(&m.unique_address),
            })
            .collect();
        members.sort_by(|a, b| a.address.cmp(&b.address));
        ClusterView {
            members,
            leader: self.cluster.leader().map(|l| l.address.0),
            coordinator: self.cluster.oldest().map(|o| o.address.0),
            coordinator_here: self.singleton,
            coordinators: self
                .coord_status
                .values()
                .map(|s| {
                    let mut s = s.clone();
                    if let Some(c) = self.coordinators.get(&s.type_name) {
                        s.shards = c.state().shards.len() as u64;
                    }
                    s.journal_error = self.journal.as_ref().and_then(ControlStore::health);
                    s
                })
                .collect(),
            cluster_name: self.scope.cluster_name().to_string(),
            cluster_id: self.scope.cluster_id(),
            journal_identity: self.fp.journal_identity.clone(),
        }
    }
}

/// How long a member waits for its data cores' region status when
/// answering a stats request.
const STATS_CORE_WAIT: Duration = Duration::from_millis(1500);

/// A [`ControlFrame::StatsReply`] as [`crate::status::MemberShardStats`].
fn member_stats(
    member: WireMember,
    regions: Vec<WireRegionStats>,
) -> crate::status::MemberShardStats {
    crate::status::MemberShardStats {
        address: member.address,
        uid: member.uid,
        regions: regions
            .into_iter()
            .map(|r| crate::status::RegionShardStats {
                core: r.core,
                proxy: r.proxy,
                registered: r.registered,
                shards: r.shards.into_iter().collect(),
                buffered: r.buffered,
                dead_letters: r.dead_letters,
            })
            .collect(),
    }
}

/// Events whose fold is `st` (same homes, regions, proxies and
/// `last_generation`, unallocated shards), for recovering a coordinator from a replicated state.
fn snapshot_events(st: &CoordinatorState) -> Vec<CoordinatorEvent> {
    let mut ev = Vec::new();
    let top = st
        .shards
        .values()
        .map(|(_, g)| *g)
        .max()
        .unwrap_or(Generation(0));
    if st.last_generation > top {
        // Carry the largest generation ever allocated with a placeholder
        // allocation that is undone at once (shard id outside every range).
        let phantom = RegionId {
            member: UniqueAddress {
                address: Address(String::new()),
                uid: MemberUid(0),
            },
            core: u16::MAX,
        };
        let shard = shardline_core::ids::ShardId(u32::MAX);
        ev.push(CoordinatorEvent::ShardHomeAllocated {
            shard,
            region: phantom.clone(),
            generation: st.last_generation,
        });
        ev.push(CoordinatorEvent::ShardHomeDeallocated {
            shard,
            generation: st.last_generation,
        });
        ev.push(CoordinatorEvent::ShardRegionTerminated { region: phantom });
    }
    for r in st.regions.keys() {
        ev.push(CoordinatorEvent::ShardRegionRegistered { region: r.clone() });
    }
    for p in &st.proxies {
        ev.push(CoordinatorEvent::ShardRegionProxyRegistered { proxy: p.clone() });
    }
    for (s, (r, g)) in &st.shards {
        ev.push(CoordinatorEvent::ShardHomeAllocated {
            shard: *s,
            region: r.clone(),
            generation: *g,
        });
    }
    for s in &st.unallocated {
        ev.push(CoordinatorEvent::ShardUnallocated { shard: *s });
    }
    ev
}

fn short_event(e: &ClusterEvent) -> String {
    match e {
        ClusterEvent::CurrentClusterState(s) => {
            format!("CurrentClusterState({} members)", s.members.len())
        }
        ClusterEvent::MemberJoined(m) => format!("MemberJoined({})", m.unique_address),
        ClusterEvent::MemberWeaklyUp(m) => format!("MemberWeaklyUp({})", m.unique_address),
        ClusterEvent::MemberUp(m) => format!("MemberUp({})", m.unique_address),
        ClusterEvent::MemberLeft(m) => format!("MemberLeft({})", m.unique_address),
        ClusterEvent::MemberExited(m) => format!("MemberExited({})", m.unique_address),
        ClusterEvent::MemberDowned(m) => format!("MemberDowned({})", m.unique_address),
        ClusterEvent::MemberRemoved { member, .. } => {
            format!("MemberRemoved({})", member.unique_address)
        }
        ClusterEvent::UnreachableMember(m) => format!("UnreachableMember({})", m.unique_address),
        ClusterEvent::ReachableMember(m) => format!("ReachableMember({})", m.unique_address),
        ClusterEvent::LeaderChanged(l) => {
            format!("LeaderChanged({:?})", l.as_ref().map(|l| l.to_string()))
        }
        other => format!("{other:?}"),
    }
}

/// An outbound control lane: connect, handshake, write batched frames.
async fn run_peer(ctl: ControlRef, addr: String, outbox: Rc<Outbox>) {
    let hello = {
        let c = ctl.borrow();
        c.fp.hello(
            (&c.me.address.0, c.me.uid.0),
            Lane::Control,
            0,
            c.scope.cluster_id(),
        )
    };
    // Whether the lane was established (its loss is then reported), and
    // whether the connect itself was refused (no listener on that port).
    let mut established = false;
    let mut refused = false;
    let res: Result<(), TransportError> = async {
        let sa: std::net::SocketAddr = addr
            .parse()
            .map_err(|e| TransportError::Refused(format!("bad address {addr}: {e}")))?;
        let mut s = match transport::connect(sa, Duration::from_secs(2)).await {
            Ok(s) => s,
            Err(e) => {
                refused = matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::ConnectionReset
                );
                return Err(e.into());
            }
        };
        established = true;
        let mut reader = FrameReader::new(MAX_FRAME_SIZE_BYTES);
        let ack = transport::client_handshake(&mut s, &mut reader, &hello).await?;
        {
            let mut c = ctl.borrow_mut();
            c.peer_connected(&addr);
            if ack.journal_identity != c.fp.journal_identity {
                c.scope.note_unreadable(&addr, &ack.journal_identity);
            }
            c.learn_cluster_id(&ack.cluster_id, &addr);
            if hello.cluster_id.is_empty() {
                if let Some(cluster_id) = c.scope.cluster_id() {
                    c.send_control(&addr, &ControlFrame::Identity { cluster_id });
                }
            }
            c.drive();
        }
        let (mut r, mut w) = s.into_split();
        let wb = outbox.clone();
        let writer = monoio::spawn(async move { transport::write_loop(&mut w, wb).await });
        // The peer writes nothing on this lane; a read returning means it closed.
        let _ = reader.fill(&mut r).await;
        outbox.close();
        let _ = writer.await;
        Err(TransportError::Closed)
    }
    .await;
    match &res {
        Err(TransportError::Refused(reason)) => {
            tracing::error!(peer = addr, reason, "control lane refused");
            ctl.borrow_mut().peer_refused(&addr, reason);
        }
        Err(TransportError::Rejected(reason)) => {
            tracing::error!(peer = addr, reason, "rejected by a member");
            ctl.borrow_mut().refuse_to_join(reason.clone());
        }
        Err(e) => tracing::debug!(peer = addr, error = %e, "control lane closed"),
        Ok(()) => {}
    }
    outbox.close();
    let mut c = ctl.borrow_mut();
    c.peer_failed(&addr, &outbox, refused);
    if refused {
        c.peer_connection_refused(&addr);
    } else if established {
        c.peer_connection_lost(&addr);
    }
}

/// An accepted node-to-node connection: handshake, then a control lane is
/// served here and a data lane is handed to its data executor.
async fn inbound(ctl: ControlRef, mut s: monoio::net::TcpStream) {
    let (fp, me, cores) = {
        let c = ctl.borrow();
        (
            c.fp.clone(),
            (c.me.address.0.clone(), c.me.uid.0),
            c.to_cores.len(),
        )
    };
    let peer = s.peer_addr().ok();
    let mut reader = FrameReader::new(MAX_FRAME_SIZE_BYTES);
    let scope = ctl.borrow().scope.clone();
    // What the cluster-id check found, acted on after the handshake.
    let learned: std::cell::RefCell<Option<crate::persistence::identity::Learned>> =
        std::cell::RefCell::new(None);
    let check = |h: &Hello| -> Result<Option<String>, transport::Refusal> {
        use crate::persistence::identity::Learned;
        if !h.cluster_id.is_empty() {
            match scope.learn_cluster_id(&h.cluster_id, &h.address) {
                Ok(l) => {
                    let refusal = match &l {
                        Learned::Conflict { reason, mine } => Some(transport::Refusal {
                            reason: reason.clone(),
                            fatal: !*mine,
                        }),
                        _ => None,
                    };
                    *learned.borrow_mut() = Some(l);
                    if let Some(r) = refusal {
                        return Err(r);
                    }
                }
                Err(e) => tracing::error!(error = %e, "cannot record the cluster id"),
            }
        }
        if h.journal_identity != fp.journal_identity {
            scope.note_unreadable(&h.address, &h.journal_identity);
        }
        Ok(scope.cluster_id())
    };
    let res = transport::server_handshake(&mut s, &mut reader, &fp, (&me.0, me.1), check).await;
    if let Some(l) = learned.borrow_mut().take() {
        use crate::persistence::identity::Learned;
        let mut c = ctl.borrow_mut();
        match l {
            Learned::Adopted => {
                tracing::info!(from = ?peer, "cluster id learned");
                c.broadcast_identity();
            }
            Learned::Conflict { reason, mine: true } => c.refuse_to_join(reason),
            _ => {}
        }
    }
    let hello = match res {
        Ok(h) => h,
        Err(TransportError::Refused(reason)) => {
            tracing::error!(?peer, reason, "refused a node connection");
            return;
        }
        Err(e) => {
            tracing::warn!(?peer, error = %e, "bad handshake on the cluster port; closing");
            return;
        }
    };
    let from = UniqueAddress {
        address: Address(hello.address.clone()),
        uid: MemberUid(hello.uid),
    };
    if hello.lane == Lane::Data as u8 {
        let core = usize::from(hello.target_core);
        if core >= cores {
            tracing::warn!(?peer, core, "data lane for a core this node does not have");
            return;
        }
        let fd = s.into_raw_fd();
        let sent = ctl.borrow().to_cores[core].send(ToCore::InboundData { fd, peer: from });
        // Take the fd back when it was not handed over, so that it is closed.
        if let Err(
            crate::runtime::RingSendError::Full(ToCore::InboundData { fd, .. })
            | crate::runtime::RingSendError::Closed(ToCore::InboundData { fd, .. }),
        ) = sent
        {
            // SAFETY: the fd was not handed over; we own it again.
            drop(unsafe { <std::net::TcpStream as std::os::fd::FromRawFd>::from_raw_fd(fd) });
        }
        return;
    }
    if hello.lane != Lane::Control as u8 {
        tracing::warn!(?peer, lane = hello.lane, "unknown lane; closing");
        return;
    }
    let (mut r, _w) = s.into_split();
    let why = loop {
        let mut err = None;
        loop {
            match reader.next_frame() {
                Ok(Some(range)) => {
                    if let Err(e) = ctl.borrow_mut().on_control_frame(reader.body(range)) {
                        err = Some(e.to_string());
                        break;
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    err = Some(e.to_string());
                    break;
                }
            }
        }
        if let Some(e) = err {
            tracing::warn!(?peer, error = %e, "protocol error on control lane; closing it");
            break e;
        }
        match reader.fill(&mut r).await {
            Ok(0) => break "closed".to_string(),
            Ok(_) => {}
            Err(e) => break e.to_string(),
        }
    };
    tracing::debug!(?peer, from = %from, why, "control lane closed");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::WireCoordinatorEvent;
    use shardline_core::ids::ShardId;

    #[test]
    fn replicated_state_events_fold_back_to_the_state_through_the_wire() {
        let region = RegionId {
            member: UniqueAddress {
                address: Address("127.0.0.1:26001".to_string()),
                uid: MemberUid(7),
            },
            core: 1,
        };
        let mut st = CoordinatorState::default();
        for e in [
            CoordinatorEvent::ShardRegionRegistered {
                region: region.clone(),
            },
            CoordinatorEvent::ShardHomeAllocated {
                shard: ShardId(1),
                region: region.clone(),
                generation: Generation(40),
            },
            CoordinatorEvent::ShardHomeAllocated {
                shard: ShardId(2),
                region,
                generation: Generation(41),
            },
            CoordinatorEvent::ShardHomeDeallocated {
                shard: ShardId(2),
                generation: Generation(41),
            },
            CoordinatorEvent::ShardUnallocated { shard: ShardId(2) },
        ] {
            st.apply(&e);
        }
        assert!(st.unallocated.contains(&ShardId(2)));
        let wire: Vec<WireCoordinatorEvent> = snapshot_events(&st).iter().map(Into::into).collect();
        let back: Vec<CoordinatorEvent> = wire.into_iter().map(CoordinatorEvent::from).collect();
        assert_eq!(CoordinatorState::from_events(back.iter()), st);
    }
}
