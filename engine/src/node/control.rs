//! The control executor: the driver of the [`ControlPlane`] (membership,
//! the coordinator singleton, the durability barrier, the graceful leave:
//! `node/plane/control.rs`). It owns the control lanes to other members,
//! the cluster listener (which hands data lanes over to the data
//! executors), the coordinator journal, the timers and the answers to the
//! node's requests; it feeds the plane what happened and carries out what
//! the plane asks for, and decides nothing about sharding or membership.

use crate::runtime::limited;
use std::cell::RefCell;
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::os::fd::IntoRawFd;
use std::rc::{Rc, Weak};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use monoio::io::Splitable;
use shardline_core::cluster::ClusterEvent;
use shardline_core::ids::{Address, MemberUid, UniqueAddress};

use super::admin::AdminAnswer;
use super::msg::{ClusterView, StatsEvent, ToControl, ToCore};
use super::plane::control::{
    ControlEvent, ControlPlane, ControlPlaneConfig, CoreCommand, JournalOp, JournalSeq, Recovery,
    RequestId, ToCores,
};
use super::Shared;
use crate::config::NodeConfig;
use crate::envelope::{encode_frame, MAX_FRAME_SIZE_BYTES};
use crate::envelope::{ControlFrame, Hello, Lane, WireMember, WireRegionStats};
use crate::persistence::coordinator::{
    ControlJournal, ControlStore, CoordinatorConfig, RecoveryStart,
};
use crate::persistence::DurableWake;
use crate::runtime::{RingReceiver, RingSender};
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
/// Most rounds of one [`Control::drive`] (each drains every queue of the
/// plane; the plane bounds its own rounds too).
const DRIVE_ROUNDS_MAX: usize = 256;

struct Control {
    plane: ControlPlane,
    me: UniqueAddress,
    epoch: Instant,
    fp: Fingerprint,
    peers: HashMap<String, Rc<Outbox>>,
    backoff: HashMap<String, (Duration, Duration)>,
    to_cores: Vec<RingSender<ToCore>>,
    shutdown: bool,
    subscribers_initialized: usize,
    shared: Arc<Shared>,
    /// The askers of stats requests under way.
    stats_replies: HashMap<RequestId, crossbeam_channel::Sender<StatsEvent>>,
    /// The askers of coordinator admin commands under way.
    admin_replies: HashMap<RequestId, crossbeam_channel::Sender<AdminAnswer>>,
    /// Told when the graceful leave ends.
    leave_done: Option<crossbeam_channel::Sender<()>>,
    /// The control core's journal (the coordinators' events), if it opened.
    journal: Option<ControlStore>,
    /// What the coordinator journal records and checks.
    journal_config: CoordinatorConfig,
    /// The plane's journal operations carried out and not durable yet, in
    /// order: (operation, LSN; 0 for one that had its outcome at once).
    unacked: VecDeque<(JournalSeq, u64)>,
    /// Woken by the journal's sync thread when held messages may go.
    durable_wake: Arc<DurableWake>,
    /// The highest LSN a durability callback is registered for.
    armed_lsn: u64,
    /// The node's data scope: cluster id, journal identity.
    scope: Arc<crate::persistence::DataScope>,
    /// This driver (for the tasks it spawns).
    this: Weak<RefCell<Control>>,
    /// The sockets of the inbound connections on the cluster port whose
    /// tasks still run (in their handshake, or reading a control lane):
    /// shut down when the node stops, so that their reads end and the
    /// tasks close them. A read waits for the peer for ever, and a task
    /// still waiting when the executor returns is never polled again: its
    /// socket stayed open for the rest of the process (a node stopped in
    /// process kept its peers' connections up, so they went on sending to
    /// it and never saw it go, and a node started again at its address was
    /// never heard).
    inbound: std::collections::HashSet<std::os::fd::RawFd>,
}

type ControlRef = Rc<RefCell<Control>>;

/// Takes an inbound connection's socket out of [`Control::inbound`] when
/// its task ends (declared after the stream, so dropped before it: the
/// number leaves the set before the socket's close lets it be reused).
struct InboundEntry {
    ctl: ControlRef,
    fd: std::os::fd::RawFd,
}

impl Drop for InboundEntry {
    fn drop(&mut self) {
        self.ctl.borrow_mut().inbound.remove(&self.fd);
    }
}

/// How long a stopping node waits for its inbound connections' tasks to
/// end once their sockets are shut down (they end at their next turn).
const INBOUND_CLOSE_WAIT: Duration = Duration::from_millis(500);

/// Milliseconds since the Unix epoch (the writer epochs' floor).
fn wall_clock_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Runs the control executor until [`ToControl::Shutdown`].
pub(crate) async fn run(init: ControlInit) {
    let pc = ControlPlaneConfig::from_node_config(&init.config, init.uid);
    let me = pc.me.clone();
    let journal_config = pc.journal.clone();
    let plane = ControlPlane::new(pc, init.epoch.elapsed());
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
    let ctl = Rc::new_cyclic(|this| {
        RefCell::new(Control {
            plane,
            me,
            epoch: init.epoch,
            fp: super::fingerprint(&init.config, &init.scope),
            peers: HashMap::new(),
            backoff: HashMap::new(),
            to_cores: init.to_cores,
            shutdown: false,
            subscribers_initialized: 0,
            shared: init.shared,
            stats_replies: HashMap::new(),
            admin_replies: HashMap::new(),
            leave_done: None,
            journal,
            journal_config,
            unacked: VecDeque::new(),
            durable_wake,
            armed_lsn: 0,
            scope: init.scope,
            this: this.clone(),
            inbound: std::collections::HashSet::new(),
        })
    });
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
                    limited!(warn, error = %e, "cluster accept failed");
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
            c.check_journal();
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
    // No new inbound connection from here (one accepted during the sweep
    // below would not be shut down and would stay open).
    crate::runtime::stop_accepting(&stop_accept, accept).await;
    // The inbound connections: end their reads, then let their tasks run
    // to close them (bounded) while this executor still turns.
    let inbound: Vec<std::os::fd::RawFd> = ctl.borrow().inbound.iter().copied().collect();
    for fd in inbound {
        // SAFETY: `fd` is the socket of a task that has not ended (it is
        // taken out of the set before its socket is closed); shutdown
        // takes no pointer and leaves the descriptor open.
        unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
    }
    let until = Instant::now() + INBOUND_CLOSE_WAIT;
    while !ctl.borrow().inbound.is_empty() && Instant::now() < until {
        monoio::time::sleep(Duration::from_millis(1)).await;
    }
    // Once more, so that the last closes reach the kernel before the
    // executor returns.
    monoio::time::sleep(Duration::from_millis(1)).await;
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

    // ----- carrying out the plane's outputs -----

    /// Carries out every output of the plane, in the order its doc gives
    /// (bounded: stops when a round produced nothing).
    fn drive(&mut self) {
        for _ in 0..DRIVE_ROUNDS_MAX {
            let mut progressed = false;
            while let Some(e) = self.plane.poll_event() {
                progressed = true;
                self.on_event(e);
            }
            while let Some(t) = self.plane.poll_transmit() {
                progressed = true;
                self.send_control(&t.to, &t.frame);
            }
            while let Some(c) = self.plane.poll_to_cores() {
                progressed = true;
                self.to_core(c);
            }
            let mut appended = BTreeSet::new();
            while let Some(op) = self.plane.poll_journal() {
                progressed = true;
                self.journal_op(op, &mut appended);
            }
            for t in appended {
                if self.journal.as_ref().is_some_and(|j| j.snapshot_due(&t)) {
                    self.plane.handle_snapshot_due(&t);
                }
            }
            if !progressed {
                break;
            }
            self.check_journal();
        }
    }

    fn on_event(&mut self, e: ControlEvent) {
        match e {
            ControlEvent::Cluster(e) => {
                if let Ok(mut subs) = self.shared.subscribers.lock() {
                    subs.retain(|s| s.try_send(e.clone()).is_ok() || !s.is_full());
                }
            }
            ControlEvent::Ready(ready) => self.shared.ready.store(ready, Ordering::Release),
            ControlEvent::Stopped { code, refusal } => {
                if let Some(reason) = refusal {
                    if let Ok(mut g) = self.shared.refusal.lock() {
                        *g = Some(reason);
                    }
                }
                self.shared.stopped.store(code, Ordering::Release);
            }
            ControlEvent::OldestUp => self.ensure_cluster_id(),
            ControlEvent::ClusterIdHeard { cluster_id } => {
                self.learn_cluster_id(&cluster_id, "a member");
            }
            ControlEvent::LeaveDone => {
                if let Some(done) = self.leave_done.take() {
                    let _ = done.try_send(());
                }
            }
            ControlEvent::AdminAnswer { id, answer } => {
                if let Some(tx) = self.admin_replies.remove(&id) {
                    let _ = tx.send(answer);
                }
            }
            ControlEvent::Stats { id, event } => {
                if let Some(tx) = self.stats_replies.get(&id) {
                    let _ = tx.send(event);
                }
            }
            ControlEvent::StatsDone { id } => {
                self.stats_replies.remove(&id);
            }
            ControlEvent::StatsRequested {
                id,
                type_name,
                reply_to,
            } => self.answer_stats(id, type_name, reply_to),
        }
    }

    fn to_core(&self, c: ToCores) {
        match c {
            ToCores::Region {
                core,
                type_name,
                msg,
            } => {
                if let Some(c) = self.to_cores.get(usize::from(core)) {
                    if c.send(ToCore::Region { type_name, msg }).is_err() {
                        tracing::warn!("core ring full or closed; control message dropped");
                    }
                }
            }
            ToCores::All(cmd) => self.to_all_cores(|| match &cmd {
                CoreCommand::Membership(m) => ToCore::Membership(m.clone()),
                CoreCommand::CoordinatorMoved => ToCore::CoordinatorMoved,
                CoreCommand::Available(a) => ToCore::Available(*a),
                CoreCommand::GracefulShutdown => ToCore::GracefulShutdown,
                CoreCommand::Stop => ToCore::Stop,
            }),
        }
    }

    /// Carries out one journal operation; `appended`: the types that
    /// appended in this round (their snapshot may be due).
    fn journal_op(&mut self, op: JournalOp, appended: &mut BTreeSet<String>) {
        let now = self.now();
        match op {
            JournalOp::Recover { type_name } => {
                let Some(j) = self.journal.as_mut() else {
                    self.plane.handle_recovered(
                        now,
                        wall_clock_ms(),
                        &type_name,
                        Recovery::NoJournal,
                    );
                    return;
                };
                match j.recover_start(&type_name, &self.journal_config) {
                    RecoveryStart::Ready(r) => {
                        let rec = match *r {
                            Ok(r) => Recovery::Read(r),
                            Err(e) => Recovery::Failed(e.to_string()),
                        };
                        self.plane
                            .handle_recovered(now, wall_clock_ms(), &type_name, rec);
                    }
                    // The database's thread reads; the outcome comes with
                    // `take_recovered` (`check_journal`).
                    RecoveryStart::Pending => {
                        tracing::info!(type_name, "coordinator recovering from the database");
                    }
                }
            }
            JournalOp::Begin {
                type_name,
                epoch,
                state,
                seq,
            } => {
                let r = match self.journal.as_mut() {
                    Some(j) => j.begin(&type_name, epoch, &state, &self.journal_config),
                    None => Ok(shardline_journal::Lsn(0)),
                };
                self.journal_outcome(now, &type_name, seq, r);
            }
            JournalOp::Append {
                type_name,
                epoch,
                event,
                seq,
            } => {
                let r = match self.journal.as_mut() {
                    Some(j) if j.epoch(&type_name).is_some() => j.append(&type_name, epoch, &event),
                    _ => Ok(shardline_journal::Lsn(0)),
                };
                self.journal_outcome(now, &type_name, seq, r);
                appended.insert(type_name);
            }
            JournalOp::SaveSnapshot { type_name, state } => {
                if let Some(j) = self.journal.as_mut() {
                    if let Err(e) = j.save_snapshot(&type_name, &state, &self.journal_config) {
                        tracing::warn!(type_name, error = %e, "coordinator snapshot failed");
                    }
                }
            }
            JournalOp::End { type_name } => {
                if let Some(j) = self.journal.as_mut() {
                    j.end(&type_name);
                }
            }
            JournalOp::NotifyDurable { seq } => {
                let lsn = self
                    .unacked
                    .iter()
                    .find(|(s, _)| *s == seq)
                    .map_or(0, |(_, l)| *l);
                if lsn > self.armed_lsn {
                    self.armed_lsn = lsn;
                    if let Some(j) = &self.journal {
                        j.notify_when_durable(
                            shardline_journal::Lsn(lsn),
                            self.durable_wake.clone(),
                        );
                    }
                }
            }
        }
    }

    /// Records the outcome of a begin or an append numbered `seq`.
    fn journal_outcome(
        &mut self,
        now: Duration,
        type_name: &str,
        seq: JournalSeq,
        r: Result<shardline_journal::Lsn, crate::persistence::coordinator::CoordinatorJournalError>,
    ) {
        match r {
            Ok(lsn) => self.unacked.push_back((seq, lsn.0)),
            Err(e) => {
                // The outcome is known: nothing waits for it.
                self.unacked.push_back((seq, 0));
                self.plane
                    .handle_journal_refused(now, type_name, e.to_string());
            }
        }
    }

    /// Feeds the plane what the journal reported: refused appends (before
    /// the durable LSN: the database journal records a refusal before its
    /// durable LSN moves past it), finished recoveries, and how far the
    /// operations carried out are durable.
    fn check_journal(&mut self) {
        let now = self.now();
        let durable = self
            .journal
            .as_ref()
            .map_or(u64::MAX, |j| j.durable_lsn().0);
        if let Some(j) = self.journal.as_mut() {
            let refused = j.take_refused();
            let recovered = j.take_recovered();
            for (t, why) in refused {
                self.plane.handle_journal_refused(now, &t, why);
            }
            for (t, r) in recovered {
                let rec = match r {
                    Ok(r) => Recovery::Read(r),
                    Err(e) => Recovery::Failed(e.to_string()),
                };
                self.plane.handle_recovered(now, wall_clock_ms(), &t, rec);
            }
        }
        let mut upto = None;
        while let Some(&(seq, lsn)) = self.unacked.front() {
            if lsn > durable {
                break;
            }
            upto = Some(seq);
            self.unacked.pop_front();
        }
        if let Some(seq) = upto {
            self.plane.handle_journal_durable(now, seq);
        }
    }

    // ----- cluster identity (the data scope's files) -----

    /// The oldest Up member establishes the cluster's id when nobody told
    /// it one (it formed the cluster): the id its data records, else a new
    /// one; every member is told it on its control lane.
    fn ensure_cluster_id(&mut self) {
        if self.plane.is_stopped() || self.scope.cluster_id().is_some() {
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

    fn refuse_to_join(&mut self, reason: String) {
        let now = self.now();
        self.plane.handle_refuse_to_join(now, reason);
    }

    // ----- control lanes -----

    fn send_control(&mut self, addr: &str, frame: &ControlFrame) {
        if addr == &*self.me.address.0 {
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
            if let Some(me) = self.this.upgrade() {
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

    fn peer_connected(&mut self, addr: &str) {
        self.backoff.remove(addr);
    }

    // ----- timers and inbox -----

    fn tick(&mut self) {
        self.check_journal();
        let now = self.now();
        if self.plane.poll_timeout().is_some_and(|t| t <= now) {
            self.plane.handle_timeout(now);
        }
        self.drive();
    }

    fn on_inbox(&mut self, m: ToControl) {
        let now = self.now();
        match m {
            ToControl::ToCoordinator { type_name, msg } => {
                self.plane.handle_to_coordinator(now, &type_name, msg);
            }
            ToControl::ToRegion { type_name, to, msg } => {
                self.plane.handle_to_region(now, &type_name, to, msg);
            }
            ToControl::RegisterType {
                type_name,
                remember_entities,
            } => self
                .plane
                .handle_register_type(now, &type_name, remember_entities),
            ToControl::Registered { core, all, warm } => {
                self.plane.handle_registered(now, core, all, warm)
            }
            ToControl::JournalFailed { core } => self.plane.handle_journal_failed(now, core),
            ToControl::ShutdownComplete { core } => self.plane.handle_shutdown_complete(now, core),
            ToControl::Status { reply } => {
                let _ = reply.send(self.view());
            }
            ToControl::ShardingStats {
                type_name,
                wait,
                reply,
            } => {
                let id = self.plane.handle_sharding_stats(now, type_name, wait);
                self.stats_replies.insert(id, reply);
            }
            ToControl::CoordinatorAdmin { cmd, reply } => {
                let id = self.plane.handle_coordinator_admin(now, cmd);
                self.admin_replies.insert(id, reply);
            }
            ToControl::Subscribe => {
                if let Ok(subs) = self.shared.subscribers.lock() {
                    let snapshot =
                        ClusterEvent::CurrentClusterState(self.plane.current_state().clone());
                    for s in subs.iter().skip(self.subscribers_initialized) {
                        let _ = s.try_send(snapshot.clone());
                    }
                    self.subscribers_initialized = subs.len();
                }
            }
            ToControl::Leave { timeout, done } => {
                self.leave_done = Some(done);
                self.plane.handle_leave(now, timeout);
            }
            ToControl::Shutdown => self.shutdown = true,
        }
        self.drive();
    }

    // ----- answers -----

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
            address: self.me.address.0.to_string(),
            uid: self.me.uid.0,
        };
        let Some(ctl) = self.this.upgrade() else {
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
        let mut v = self.plane.view();
        let journal_error = self.journal.as_ref().and_then(ControlStore::health);
        for s in &mut v.coordinators {
            s.journal_error = journal_error.clone();
        }
        v.cluster_name = self.scope.cluster_name().to_string();
        v.cluster_id = self.scope.cluster_id();
        v.journal_identity = self.fp.journal_identity.clone();
        v
    }
}

/// How long a member waits for its data cores' region status when
/// answering a stats request.
const STATS_CORE_WAIT: Duration = Duration::from_millis(1500);

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
        let writer = monoio::spawn(async move { transport::write_loop(&mut w, wb, None).await });
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
            let mut c = ctl.borrow_mut();
            let now = c.now();
            c.plane.handle_seed_refused(now, &addr, reason);
            c.drive();
        }
        Err(TransportError::Rejected(reason)) => {
            tracing::error!(peer = addr, reason, "rejected by a member");
            let mut c = ctl.borrow_mut();
            c.refuse_to_join(reason.clone());
            c.drive();
        }
        Err(e) => tracing::debug!(peer = addr, error = %e, "control lane closed"),
        Ok(()) => {}
    }
    outbox.close();
    let mut c = ctl.borrow_mut();
    c.peer_failed(&addr, &outbox, refused);
    let now = c.now();
    if refused {
        c.plane.handle_connection_refused(now, &addr);
    } else if established {
        c.plane.handle_connection_lost(now, &addr);
    }
    c.drive();
}

/// An accepted node-to-node connection: handshake, then a control lane is
/// served here and a data lane is handed to its data executor.
async fn inbound(ctl: ControlRef, mut s: monoio::net::TcpStream) {
    let fd = std::os::fd::AsRawFd::as_raw_fd(&s);
    ctl.borrow_mut().inbound.insert(fd);
    let _entry = InboundEntry {
        ctl: ctl.clone(),
        fd,
    };
    let (fp, me, cores) = {
        let c = ctl.borrow();
        (
            c.fp.clone(),
            (c.me.address.0.to_string(), c.me.uid.0),
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
        c.drive();
    }
    let hello = match res {
        Ok(h) => h,
        Err(TransportError::Refused(reason)) => {
            // A misconfigured node retries its join: one line per window.
            limited!(error, ?peer, reason, "refused a node connection");
            return;
        }
        Err(e) => {
            // A health check or scanner on this port may cause one per
            // connection.
            limited!(warn, ?peer, error = %e, "bad handshake on the cluster port; closing");
            return;
        }
    };
    let from = UniqueAddress {
        address: Address(hello.address.clone().into()),
        uid: MemberUid(hello.uid),
    };
    if hello.lane == Lane::Data as u8 {
        let core = usize::from(hello.target_core);
        if core >= cores {
            limited!(
                warn,
                ?peer,
                core,
                "data lane for a core this node does not have"
            );
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
        limited!(warn, ?peer, lane = hello.lane, "unknown lane; closing");
        return;
    }
    let (mut r, _w) = s.into_split();
    let why = loop {
        let mut err = None;
        loop {
            match reader.next_frame() {
                Ok(Some(range)) => {
                    let mut c = ctl.borrow_mut();
                    let now = c.now();
                    let r = c.plane.handle_control_frame(now, reader.body(range));
                    c.drive();
                    if let Err(e) = r {
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
