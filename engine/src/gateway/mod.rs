//! The native client protocol front, served by every data executor on the
//! shared `client_address` (SO_REUSEPORT: the kernel spreads connections over
//! the executors).
//!
//! A connection is read in batches; every complete frame in a batch is
//! handled at once (pipelining), the responses are queued in the
//! connection's [`Outbox`] and written together. A request whose payload
//! exceeds `requests.max_message_size_bytes` is answered `TooLarge` (the
//! same limit as the HTTP front's and the node-to-node wire's, so a
//! request's fate never depends on where its entity lives). A frame longer
//! than that limit plus the envelope overhead is answered with a
//! `TooLarge` frame with request id 0 (its request id was not read), and
//! the connection is closed after the frame is written and its input
//! drained for at most [`LINGER`]. Any other protocol error (a body that
//! fails validation) closes that connection only, with a logged reason; a
//! bad entity type or id gets an error response.

pub mod http;

use std::cell::RefCell;
use std::rc::Rc;
use std::time::{Duration, Instant};

use monoio::io::Splitable;
use monoio::net::TcpStream;

use crate::envelope::{encode_frame, ServerFrame, Status, MAX_FRAME_SIZE_BYTES};
use crate::node::core::Core;
use crate::node::{NodeStatus, ToControl, ToCore};
use crate::transport::{self, FrameReader, Outbox};

/// How long a status request waits for the other executors.
const STATUS_TIMEOUT: Duration = Duration::from_secs(2);
/// How long the input of a connection closed for an oversized frame is
/// read and discarded, so that the client reads the `TooLarge` frame
/// instead of a reset.
pub const LINGER: Duration = Duration::from_secs(2);
/// Most bytes discarded during that linger.
const LINGER_MAX_BYTES: usize = 64 << 20;

/// Serves one client connection until it closes or breaks the protocol.
pub(crate) async fn serve_client(core: Rc<RefCell<Core>>, stream: TcpStream) {
    let peer = stream.peer_addr().ok();
    let outbox = Rc::new(Outbox::default());
    let conn = core.borrow_mut().add_conn(outbox.clone());
    http::serve::native_connection(true);
    let (mut r, mut w) = stream.into_split();
    let wb = outbox.clone();
    monoio::spawn(async move {
        let _ = transport::write_loop(&mut w, wb).await;
    });
    let max_frame = core.borrow().max_request_frame_bytes();
    let mut reader = FrameReader::new(max_frame.min(MAX_FRAME_SIZE_BYTES));
    let mut linger = false;
    loop {
        // Back-pressure: a client that does not read its responses is not read.
        while core.borrow().high_water(conn) {
            if outbox.closed.get() {
                break;
            }
            monoio::time::sleep(Duration::from_millis(1)).await;
        }
        match reader.fill(&mut r).await {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) => {
                tracing::debug!(?peer, error = %e, "client read failed");
                break;
            }
        }
        let mut bad = None;
        loop {
            match reader.next_frame() {
                Ok(Some(range)) => {
                    if let Err(e) = Core::on_client_frame(&core, conn, reader.body(range)) {
                        bad = Some(e);
                        break;
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    bad = Some(e);
                    break;
                }
            }
        }
        if let Some(e) = bad {
            if let crate::envelope::FrameError::TooLarge { .. } = e {
                tracing::info!(?peer, error = %e, "request frame too large; answered TooLarge, closing the connection");
                let f = ServerFrame {
                    request_id: 0,
                    status: Status::TooLarge as u8,
                    payload: format!("{e} (requests.max_message_size_bytes)").into_bytes(),
                };
                let _ = encode_frame(&f, &mut outbox.buf.borrow_mut());
                outbox.close();
                linger = true;
            } else {
                tracing::warn!(?peer, error = %e, "protocol error from client; closing the connection");
            }
            break;
        }
        if outbox.closed.get() {
            break;
        }
    }
    if linger {
        // The writer sends the TooLarge frame; the input (the rest of the
        // oversized frame) is discarded meanwhile, bounded in time and
        // bytes, so that closing does not reset the connection first.
        let until = Instant::now() + LINGER;
        let mut drained = 0usize;
        let mut buf = vec![0u8; 64 * 1024];
        while drained < LINGER_MAX_BYTES && Instant::now() < until {
            let left = until.saturating_duration_since(Instant::now());
            match monoio::time::timeout(left, monoio::io::AsyncReadRent::read(&mut r, buf)).await {
                Ok((Ok(n), b)) if n > 0 => {
                    drained += n;
                    buf = b;
                }
                _ => break,
            }
        }
    }
    core.borrow_mut().remove_conn(conn);
    http::serve::native_connection_closed(conn);
}

/// Answers a `NodeStatus` request: collects the cluster view from the control
/// executor and the region views from every data executor.
pub(crate) async fn answer_status(core: Rc<RefCell<Core>>, conn: u64, request_id: u64) {
    let (code, payload) = match collect_status(&core).await {
        Some(status) => match serde_json::to_vec(&status) {
            Ok(p) => (Status::Ok, p),
            Err(e) => (Status::EntityFailed, e.to_string().into_bytes()),
        },
        None => (
            Status::TimedOut,
            b"control executor did not answer".to_vec(),
        ),
    };
    let c = core.borrow();
    if let Some(o) = c.conn_outbox(conn) {
        let f = ServerFrame {
            request_id,
            status: code as u8,
            payload,
        };
        let _ = encode_frame(&f, &mut o.buf.borrow_mut());
        o.flush();
    }
}

/// Answers a native `CoordinatorAdmin` request (see
/// [`coordinator_admin`]): `Ok` with the JSON, or the error status with the
/// reason as text.
pub(crate) async fn answer_coordinator_admin(
    core: Rc<RefCell<Core>>,
    conn: u64,
    request_id: u64,
    cmd: crate::node::admin::CoordinatorCommand,
) {
    let (code, payload) = match coordinator_admin(&core, cmd).await {
        Ok(json) => (Status::Ok, json),
        Err((st, why)) => (st, why.into_bytes()),
    };
    let c = core.borrow();
    if let Some(o) = c.conn_outbox(conn) {
        let f = ServerFrame {
            request_id,
            status: code as u8,
            payload,
        };
        let _ = encode_frame(&f, &mut o.buf.borrow_mut());
        o.flush();
    }
}

/// Runs a coordinator admin command through the control executor, which
/// answers it from the coordinators on this member or forwards it to the
/// member that runs them. `Unavailable` when the control executor does not
/// answer in time.
pub(crate) async fn coordinator_admin(
    core: &Rc<RefCell<Core>>,
    cmd: crate::node::admin::CoordinatorCommand,
) -> crate::node::admin::AdminAnswer {
    let (tx, rx) = crossbeam_channel::bounded(1);
    let sent = core
        .borrow()
        .to_control()
        .send(ToControl::CoordinatorAdmin { cmd, reply: tx })
        .is_ok();
    let wait = crate::node::admin::FORWARD_TIMEOUT + Duration::from_secs(1);
    let deadline = Instant::now() + wait;
    while sent && Instant::now() < deadline {
        if let Ok(a) = rx.try_recv() {
            return a;
        }
        monoio::time::sleep(Duration::from_millis(1)).await;
    }
    Err((
        Status::Unavailable,
        "the node's control executor did not answer".into(),
    ))
}

/// Collects this node's status: the cluster view from the control executor
/// and the region views from every data executor (waiting at most
/// `STATUS_TIMEOUT`). `None` when the control executor did not answer.
pub(crate) async fn collect_status(core: &Rc<RefCell<Core>>) -> Option<NodeStatus> {
    let (ctx, crx) = crossbeam_channel::bounded(1);
    let (rtx, rrx) = crossbeam_channel::bounded(64);
    let (mut status, others) = {
        let c = core.borrow();
        let _ = c.to_control().send(ToControl::Status { reply: ctx });
        let mut others = 0;
        for (i, tx) in c.to_cores().iter().enumerate() {
            if i != usize::from(c.index()) && tx.send(ToCore::Status { reply: rtx.clone() }).is_ok()
            {
                others += 1;
            }
        }
        let st = NodeStatus {
            address: c.me().address.0.clone(),
            uid: c.me().uid.0,
            client_address: c.client_address(),
            members: Vec::new(),
            leader: None,
            coordinator: None,
            coordinator_here: false,
            regions: c.status(),
            coordinators: Vec::new(),
            cluster_name: String::new(),
            cluster_id: None,
            journal_identity: String::new(),
        };
        (st, others)
    };
    let deadline = Instant::now() + STATUS_TIMEOUT;
    let mut got_cluster = false;
    let mut got_cores = 0;
    while Instant::now() < deadline && (!got_cluster || got_cores < others) {
        if let Ok(v) = crx.try_recv() {
            status.members = v.members;
            status.leader = v.leader;
            status.coordinator = v.coordinator;
            status.coordinator_here = v.coordinator_here;
            status.coordinators = v.coordinators;
            status.cluster_name = v.cluster_name;
            status.cluster_id = v.cluster_id;
            status.journal_identity = v.journal_identity;
            got_cluster = true;
        }
        while let Ok(mut r) = rrx.try_recv() {
            status.regions.append(&mut r);
            got_cores += 1;
        }
        monoio::time::sleep(Duration::from_millis(1)).await;
    }
    status
        .regions
        .sort_by(|a, b| (a.type_name.as_str(), a.core).cmp(&(b.type_name.as_str(), b.core)));
    got_cluster.then_some(status)
}

/// How long a cluster-wide stats request waits for the other members.
pub(crate) const CLUSTER_STATS_TIMEOUT: Duration = Duration::from_secs(3);

/// Gathers the cluster-wide sharding stats of `type_name` (Akka's
/// `GetClusterShardingStats`): this node's regions from `local`, and every
/// other Up member's over the control lanes, waiting at most `wait`.
/// Members that are unreachable, or that do not answer in time, are listed
/// in `failed` with the reason. `None` when the control executor did not
/// answer at all.
pub(crate) async fn collect_cluster_stats(
    core: &Rc<RefCell<Core>>,
    type_name: &str,
    local: &NodeStatus,
    wait: Duration,
) -> Option<crate::status::ClusterShardingStats> {
    use crate::node::StatsEvent;
    use crate::status::{ClusterShardingStats, FailedMember, MemberShardStats, RegionShardStats};
    let (tx, rx) = crossbeam_channel::unbounded();
    core.borrow()
        .to_control()
        .send(ToControl::ShardingStats {
            type_name: type_name.to_string(),
            wait,
            reply: tx,
        })
        .ok()?;
    let mut stats = ClusterShardingStats::default();
    stats.members.push(MemberShardStats {
        address: local.address.clone(),
        uid: local.uid,
        regions: local
            .regions
            .iter()
            .filter(|r| r.type_name == type_name)
            .map(RegionShardStats::of)
            .collect(),
    });
    let deadline = Instant::now() + wait;
    let mut asked: Option<Vec<(String, u64)>> = None;
    loop {
        while let Ok(ev) = rx.try_recv() {
            match ev {
                StatsEvent::Asked {
                    asked: a,
                    unreachable,
                } => {
                    stats
                        .failed
                        .extend(unreachable.into_iter().map(|(address, uid)| FailedMember {
                            address,
                            uid,
                            reason: "unreachable".into(),
                        }));
                    asked = Some(a);
                }
                StatsEvent::Answer(m) => {
                    if let Some(a) = &mut asked {
                        if let Some(i) = a
                            .iter()
                            .position(|(addr, uid)| *addr == m.address && *uid == m.uid)
                        {
                            a.swap_remove(i);
                            stats.members.push(m);
                        }
                    }
                }
            }
        }
        let done = asked.as_ref().is_some_and(|a| a.is_empty());
        if done || Instant::now() >= deadline {
            break;
        }
        monoio::time::sleep(Duration::from_millis(1)).await;
    }
    let missing = asked?;
    stats
        .failed
        .extend(missing.into_iter().map(|(address, uid)| FailedMember {
            address,
            uid,
            reason: format!("no answer within {} ms", wait.as_millis()),
        }));
    stats.members.sort_by(|a, b| a.address.cmp(&b.address));
    stats.failed.sort_by(|a, b| a.address.cmp(&b.address));
    Some(stats)
}
