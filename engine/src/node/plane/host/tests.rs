//! The entity host driven through its API beside a real [`DataPlane`], with
//! a small driver loop standing in for `node/core.rs` (the core's own inbox
//! is a queue here).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use shardline_core::ids::{Address, MemberUid, RegionId};
use shardline_core::sharding::{Generation, RegionMsg, RegionSettings};

use super::*;
use crate::node::plane::data::DataPlaneConfig;

const T: &str = "probe";

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

fn id(s: &str) -> EntityId {
    EntityId::new(s).expect("entity id")
}

/// What the probe entities did, in order (shared by every incarnation).
type Log = Arc<Mutex<Vec<String>>>;

/// A test entity whose message says what it does: `echo:X` replies `X`,
/// `timer:K:S` arms timer `K` for `S` seconds, `passivate` asks to stop,
/// `keep-passivate` asks to stop and holds its stop (as `keep:hold`),
/// `ask:E:S` asks entity `E` with a timeout of `S` seconds, `hold` defers
/// its reply and never answers, `watch:E` watches entity `E`.
struct Probe {
    me: String,
    log: Log,
    /// `keep:abandon` / `keep:hold`: a stop keeps it; whether it may stop
    /// after its stop wait.
    keep: Option<bool>,
}

impl Probe {
    fn note(&self, s: String) {
        self.log.lock().expect("log").push(s);
    }
}

impl Entity for Probe {
    fn on_start(&mut self, _ctx: &mut EntityContext<'_>) {
        self.note(format!("start {}", self.me));
    }

    fn handle(&mut self, ctx: &mut EntityContext<'_>, message: &[u8]) -> Result<(), EntityError> {
        let m = String::from_utf8_lossy(message).to_string();
        let parts: Vec<&str> = m.split(':').collect();
        self.note(format!("{} got {m}", self.me));
        match parts.as_slice() {
            ["echo", x] => ctx.reply(x.as_bytes()),
            ["timer", k, s] => {
                let (k, s) = (k.parse().unwrap_or(0), s.parse().unwrap_or(0));
                ctx.set_timer(k, secs(s));
            }
            ["passivate"] => ctx.passivate(),
            ["keep", how] => self.keep = Some(*how == "abandon"),
            ["keep-passivate"] => {
                self.keep = Some(false);
                ctx.passivate();
            }
            ["ask", e, s] => {
                let _ = ctx.ask(T, &id(e), "hold", secs(s.parse().unwrap_or(1)));
            }
            ["hold"] => {
                let _ = ctx.defer_reply();
            }
            // 2,000 bytes, over the rig's 1,024-byte message limit.
            ["big-ask", e] => {
                let _ = ctx.ask(T, &id(e), vec![b'x'; 2_000], secs(5));
            }
            ["big-tell", e] => ctx.tell(T, &id(e), vec![b'x'; 2_000]),
            ["big-forward", e] => ctx.forward(T, &id(e), vec![b'x'; 2_000]),
            ["watch", e] => ctx.watch(T, &id(e)),
            _ => return Err(EntityError::Failed(format!("unknown message {m}"))),
        }
        Ok(())
    }

    fn on_timer(&mut self, _ctx: &mut EntityContext<'_>, key: u64) {
        self.note(format!("{} timer {key}", self.me));
    }

    fn on_stopping(&mut self) -> bool {
        self.keep.is_some()
    }

    fn may_stop_waiting(&mut self) -> bool {
        self.note(format!("{} asked to stop waiting", self.me));
        self.keep == Some(true)
    }

    fn on_stop(&mut self, _ctx: &mut EntityContext<'_>) {
        self.note(format!("stop {}", self.me));
    }

    fn on_ask_reply(
        &mut self,
        _ctx: &mut EntityContext<'_>,
        _ask: AskId,
        reply: Result<Vec<u8>, EntityAskError>,
    ) -> Result<(), EntityError> {
        self.note(format!("{} ask reply {reply:?}", self.me));
        Ok(())
    }

    fn on_terminated(
        &mut self,
        _ctx: &mut EntityContext<'_>,
        _type_name: &str,
        entity_id: &EntityId,
        reason: TerminatedReason,
    ) {
        self.note(format!("{} terminated {entity_id} {reason:?}", self.me));
    }
}

/// A plane and a host with the probe type registered and its one shard
/// homed here, and the driver's queues.
struct Rig {
    plane: DataPlane,
    host: EntityHost,
    ty: TypeIdx,
    log: Log,
    /// The core's own inbox: messages between entities, answers to asks.
    inbox: VecDeque<(String, UserEnvelope)>,
    ask_answers: VecDeque<(AskId, Status, Vec<u8>)>,
    /// Replies to the fronts (and anything else the driver answers).
    replies: Vec<(ReplyTo, Status, Vec<u8>)>,
}

impl Rig {
    fn new(idle: Option<Duration>) -> Rig {
        let me = RegionId {
            member: UniqueAddress {
                address: Address("127.0.0.1:7101".into()),
                uid: MemberUid(1),
            },
            core: 0,
        };
        let mut plane = DataPlane::new(DataPlaneConfig {
            me: me.clone(),
            number_of_shards: 1,
            ask_timeout: secs(30),
            max_message_size_bytes: 1024,
            warm_allocation: false,
        });
        let mut host = EntityHost::new(HostConfig {
            core: 0,
            cores: 1,
            number_of_shards: 1,
            ask_timeout: secs(30),
            max_message_size_bytes: 1024,
        });
        let mut settings = RegionSettings::default();
        settings.passivation.idle_timeout = idle;
        let ty = plane
            .handle_register_type(Duration::ZERO, T, settings, true, false)
            .expect("new type");
        let log: Log = Arc::default();
        let l = log.clone();
        let factory: EntityFactory = Arc::new(move |e: &EntityId| {
            Box::new(Probe {
                me: e.as_str().to_string(),
                log: l.clone(),
                keep: None,
            }) as Box<dyn Entity>
        });
        host.handle_register_type(T, Some(factory), None);
        let mut rig = Rig {
            plane,
            host,
            ty,
            log,
            inbox: VecDeque::new(),
            ask_answers: VecDeque::new(),
            replies: Vec::new(),
        };
        rig.plane
            .handle_region_msg(Duration::ZERO, T, RegionMsg::RegisterAck);
        rig.plane.handle_region_msg(
            Duration::ZERO,
            T,
            RegionMsg::ShardHome {
                shard: ShardId(0),
                region: me,
                generation: Generation(1),
            },
        );
        rig.run(Duration::ZERO);
        rig
    }

    /// What the driver does after an input: drain both, route the messages
    /// the entities sent and the lifecycle messages, until all is quiet.
    fn run(&mut self, now: Duration) {
        loop {
            loop {
                while let Some(o) = self.host.poll_output() {
                    match o {
                        HostOutput::Reply {
                            to: ReplyTo::EntityAsk { id },
                            status,
                            payload,
                        } => self.ask_answers.push_back((AskId(id), status, payload)),
                        HostOutput::Reply {
                            to,
                            status,
                            payload,
                        } => self.replies.push((to, status, payload)),
                        HostOutput::Send {
                            type_name,
                            envelope,
                        } => self.inbox.push_back((type_name, envelope)),
                    }
                }
                let Some(o) = self.plane.poll_output(now) else {
                    break;
                };
                if let Some(DataOutput::Reply {
                    to,
                    status,
                    payload,
                }) = self.host.handle_plane_output(now, &mut self.plane, o)
                {
                    self.replies.push((to, status, payload));
                }
            }
            if let Some((t, env)) = self.inbox.pop_front() {
                self.plane.handle_message(now, &t, env);
                continue;
            }
            if let Some((ask, status, payload)) = self.ask_answers.pop_front() {
                let reply = if status == Status::Ok {
                    Ok(payload)
                } else {
                    Err(EntityAskError::Failed { status, payload })
                };
                self.host.handle_ask_reply(now, &mut self.plane, ask, reply);
                continue;
            }
            let system = self.host.take_system();
            if system.is_empty() {
                break;
            }
            for (t, env) in system {
                self.plane.handle_message(now, &t, env);
            }
        }
    }

    /// A front's request `msg` to entity `e` (connection 7, request `req`).
    fn request(&mut self, now: Duration, req: u64, e: &str, msg: &str) {
        self.batch(now, e, &[(req, msg)]);
    }

    /// Front requests `(request, message)` to entity `e`, all handed to the
    /// plane before the host runs any (one drain, as a batch read from a
    /// connection), then the driver's loop.
    fn batch(&mut self, now: Duration, e: &str, requests: &[(u64, &str)]) {
        for (req, msg) in requests {
            self.plane.handle_client_request(
                now,
                7,
                *req,
                T.as_bytes(),
                e.as_bytes(),
                bytes::Bytes::copy_from_slice(msg.as_bytes()),
            );
        }
        self.run(now);
    }

    /// Time passes to `now`: both parts' timeouts, as the driver's tick.
    fn advance(&mut self, now: Duration) {
        if self.plane.poll_timeout().is_some_and(|d| d <= now) {
            self.plane.handle_timeout(now);
        }
        self.run(now);
        if self.host.poll_timeout().is_some_and(|d| d <= now) {
            self.host.handle_timeout(now, &mut self.plane);
        }
        self.run(now);
    }

    fn reply_to(&self, req: u64) -> Option<(Status, Vec<u8>)> {
        self.replies.iter().find_map(|(to, s, p)| match to {
            ReplyTo::Client {
                conn: 7,
                request_id,
            } if *request_id == req => Some((*s, p.clone())),
            _ => None,
        })
    }

    fn log(&self) -> Vec<String> {
        self.log.lock().expect("log").clone()
    }

    fn active(&self) -> usize {
        self.host.figures(self.ty).expect("type").entities
    }

    /// The entities the region counts as running in shard 0.
    fn region_entities(&self) -> Vec<String> {
        self.plane
            .region(self.ty)
            .shard_region_state()
            .shards
            .into_values()
            .flat_map(|ids| ids.into_iter().map(|i| i.as_str().to_string()))
            .collect()
    }
}

#[test]
fn first_delivery_starts_the_entity_and_its_reply_goes_out() {
    let mut rig = Rig::new(None);
    assert_eq!(rig.active(), 0);
    rig.request(secs(1), 1, "a", "echo:hello");
    assert_eq!(rig.log(), vec!["start a", "a got echo:hello"]);
    assert_eq!(rig.reply_to(1), Some((Status::Ok, b"hello".to_vec())));
    // The same incarnation gets the next message.
    rig.request(secs(1), 2, "a", "echo:again");
    assert_eq!(rig.reply_to(2), Some((Status::Ok, b"again".to_vec())));
    let f = rig.host.figures(rig.ty).expect("type");
    assert_eq!((f.entities, f.activated, f.delivered), (1, 1, 2));
    // A handler that fails answers EntityFailed and its incarnation stops.
    rig.request(secs(1), 3, "a", "bogus");
    assert_eq!(rig.reply_to(3).map(|r| r.0), Some(Status::EntityFailed));
    assert_eq!(rig.active(), 0);
    assert!(rig.region_entities().is_empty(), "the region was told");
}

#[test]
fn an_armed_timer_fires_at_its_time() {
    let mut rig = Rig::new(None);
    rig.request(secs(1), 1, "a", "timer:5:3");
    assert_eq!(rig.reply_to(1).map(|r| r.0), Some(Status::Ok));
    let due = rig.plane.poll_timeout().expect("the timer is armed");
    assert!(due <= secs(4), "due by 3 s after the message: {due:?}");
    rig.advance(secs(3));
    assert!(
        !rig.log().iter().any(|l| l.contains(" timer 5")),
        "not before its time"
    );
    rig.advance(secs(4));
    let fired: Vec<String> = rig
        .log()
        .into_iter()
        .filter(|l| l.contains(" timer "))
        .collect();
    assert_eq!(fired, vec!["a timer 5"]);
    rig.advance(secs(100));
    assert_eq!(
        rig.log().iter().filter(|l| l.contains(" timer 5")).count(),
        1,
        "once"
    );
}

#[test]
fn passivation_stops_the_entity_and_the_region_is_told() {
    let mut rig = Rig::new(None);
    rig.request(secs(1), 1, "a", "echo:x");
    assert_eq!(rig.region_entities(), vec!["a"]);
    rig.request(secs(2), 2, "a", "passivate");
    assert_eq!(rig.reply_to(2).map(|r| r.0), Some(Status::Ok));
    assert!(rig.log().contains(&"stop a".to_string()), "{:?}", rig.log());
    assert_eq!(rig.active(), 0, "the host no longer runs it");
    assert!(
        rig.region_entities().is_empty(),
        "the region knows it stopped"
    );
    // The next message starts a new incarnation.
    rig.request(secs(3), 3, "a", "echo:y");
    assert_eq!(rig.reply_to(3), Some((Status::Ok, b"y".to_vec())));
    assert_eq!(rig.host.figures(rig.ty).expect("type").activated, 2);
}

#[test]
fn a_kept_stopping_entity_stops_after_its_stop_wait_only_if_it_may() {
    let mut rig = Rig::new(None);
    rig.request(secs(1), 1, "a", "keep:abandon");
    rig.request(secs(1), 2, "b", "keep:hold");
    rig.request(secs(2), 3, "a", "passivate");
    rig.request(secs(2), 4, "b", "passivate");
    let stopped = |rig: &Rig, e: &str| rig.log().contains(&format!("stop {e}"));
    assert!(!stopped(&rig, "a") && !stopped(&rig, "b"), "both kept");
    assert_eq!(rig.region_entities().len(), 2, "the region waits for both");
    let due = rig.host.poll_timeout().expect("a stop wait is due");
    assert_eq!(due, secs(2) + crate::entity::STOP_WAIT);
    rig.advance(secs(6));
    assert!(!stopped(&rig, "a"), "not before the stop wait");
    rig.advance(secs(7));
    assert!(stopped(&rig, "a"), "a may stop waiting: {:?}", rig.log());
    assert!(!stopped(&rig, "b"), "b keeps waiting");
    assert_eq!(rig.region_entities(), vec!["b"], "the region was told of a");
    // b is asked again one stop wait later, not on every tick.
    let asked = |rig: &Rig| {
        rig.log()
            .iter()
            .filter(|l| *l == "b asked to stop waiting")
            .count()
    };
    assert_eq!(asked(&rig), 1);
    rig.advance(secs(8));
    assert_eq!(asked(&rig), 1);
    rig.advance(secs(12));
    assert_eq!(asked(&rig), 2);
    assert!(!stopped(&rig, "b"));
    // The node's stop drain ends every wait.
    rig.host.handle_drain_end(secs(13), &mut rig.plane);
    rig.run(secs(13));
    assert!(stopped(&rig, "b"));
}

#[test]
fn a_kept_entity_with_nothing_in_flight_does_not_wake_the_core_in_a_loop() {
    let dir = tempfile::tempdir().expect("tempdir");
    let always = crate::config::Durability::Named(crate::config::DurabilityName::Always);
    let journal =
        crate::persistence::CoreJournal::open_local(dir.path(), 0, &always, None).expect("journal");
    let mut rig = Rig::new(None);
    rig.host.set_journal(journal);
    let wake = rig.host.durable_wake();
    rig.request(secs(1), 1, "b", "keep:hold");
    rig.request(secs(2), 2, "b", "passivate");
    // The driver's durability task: one call per notice, as long as the
    // wake keeps firing (bounded here).
    let mut notices = 0;
    while wake.take_notified() && notices < 100 {
        notices += 1;
        rig.host.handle_durable(secs(2), &mut rig.plane, 0);
        rig.run(secs(2));
    }
    assert_eq!(notices, 0, "nothing is in flight: no notice to wait for");
    assert!(!rig.log().contains(&"stop b".to_string()), "b is kept");
    // Another notice of the core (any entity's) asks it again, once.
    wake.notify();
    assert!(wake.take_notified());
    rig.host.handle_durable(secs(3), &mut rig.plane, 0);
    rig.run(secs(3));
    assert!(!wake.take_notified(), "and does not fire the wake again");
    rig.host.handle_drain_end(secs(4), &mut rig.plane);
    rig.run(secs(4));
    assert!(rig.log().contains(&"stop b".to_string()));
}

#[test]
fn an_ask_to_another_entity_times_out() {
    let mut rig = Rig::new(None);
    // `a` asks `b`, which holds its reply and never answers.
    rig.request(secs(1), 1, "a", "ask:b:2");
    assert!(
        rig.log().contains(&"b got hold".to_string()),
        "the ask reached b: {:?}",
        rig.log()
    );
    let due = rig.host.poll_timeout().expect("the ask's timeout");
    assert_eq!(due, secs(3));
    rig.advance(secs(2));
    assert!(!rig.log().iter().any(|l| l.contains("ask reply")));
    rig.advance(secs(3));
    let answers: Vec<String> = rig
        .log()
        .into_iter()
        .filter(|l| l.contains("ask reply"))
        .collect();
    assert_eq!(answers, vec!["a ask reply Err(TimedOut)"]);
    assert!(
        rig.host.poll_timeout().is_none(),
        "nothing left to time out"
    );
}

#[test]
fn a_message_between_entities_over_the_size_limit_is_refused_at_its_sender() {
    let mut rig = Rig::new(None);
    rig.request(secs(1), 1, "b", "echo:up");
    rig.request(secs(1), 2, "a", "big-ask:b");
    rig.request(secs(1), 3, "a", "big-tell:b");
    rig.request(secs(1), 4, "a", "big-forward:b");
    let log = rig.log();
    assert!(
        !log.iter().any(|l| l.starts_with("b got x")),
        "nothing over the limit reached b: {log:?}"
    );
    let answers: Vec<&String> = log.iter().filter(|l| l.contains("ask reply")).collect();
    assert_eq!(answers.len(), 1, "{log:?}");
    assert!(answers[0].contains("TooLarge"), "{answers:?}");
    // The forwarded request's sender (the front) gets the refusal.
    assert!(
        rig.replies
            .iter()
            .any(|(to, status, _)| *status == Status::TooLarge
                && matches!(to, ReplyTo::Client { request_id: 4, .. })),
        "{:?}",
        rig.replies
    );
}

#[test]
fn a_watch_delivers_terminated_when_the_watched_entity_stops() {
    let mut rig = Rig::new(None);
    rig.request(secs(1), 1, "b", "echo:up");
    rig.request(secs(1), 2, "a", "watch:b");
    assert!(!rig.log().iter().any(|l| l.contains("terminated")));
    rig.request(secs(2), 3, "b", "passivate");
    let notes: Vec<String> = rig
        .log()
        .into_iter()
        .filter(|l| l.contains("terminated"))
        .collect();
    assert_eq!(notes, vec!["a terminated b Stopped"]);
    // Once: a new incarnation of b stopping again tells nobody.
    rig.request(secs(3), 4, "b", "passivate");
    assert_eq!(
        rig.log()
            .iter()
            .filter(|l| l.contains("terminated"))
            .count(),
        1
    );
}

#[test]
fn a_message_queued_behind_one_that_failed_starts_a_new_incarnation_the_region_knows() {
    let mut rig = Rig::new(None);
    // Both reach the plane before the host runs either: the first fails
    // (its incarnation stops), the second waits in the plane's queue.
    rig.batch(secs(1), "a", &[(1, "bogus"), (2, "echo:y")]);
    assert_eq!(rig.reply_to(1).map(|r| r.0), Some(Status::EntityFailed));
    assert_eq!(rig.reply_to(2), Some((Status::Ok, b"y".to_vec())));
    assert_eq!(
        rig.log(),
        vec![
            "start a",
            "a got bogus",
            "stop a",
            "start a",
            "a got echo:y"
        ]
    );
    let f = rig.host.figures(rig.ty).expect("type");
    assert_eq!((f.entities, f.activated), (1, 2));
    // The new incarnation is the region's live entity (it passivates it,
    // hands it off, counts it), not one only the host runs.
    assert_eq!(rig.region_entities(), vec!["a"]);
    rig.request(secs(2), 3, "a", "passivate");
    assert!(rig.region_entities().is_empty());
    assert_eq!(rig.active(), 0);
}

#[test]
fn the_node_stop_stops_every_running_incarnation_and_empties_the_slots() {
    let mut rig = Rig::new(None);
    for (req, e) in [(1, "a"), (2, "b"), (3, "c")] {
        rig.request(secs(1), req, e, "echo:x");
    }
    assert_eq!(rig.active(), 3);
    rig.plane.handle_stop();
    rig.host.handle_node_stop(secs(2), &mut rig.plane);
    rig.run(secs(2));
    let stops: Vec<String> = rig
        .log()
        .into_iter()
        .filter(|l| l.starts_with("stop "))
        .collect();
    assert_eq!(stops, vec!["stop a", "stop b", "stop c"], "by id");
    assert_eq!(rig.active(), 0);
}

#[test]
fn a_stop_for_an_incarnation_that_failed_does_not_stop_the_next_one() {
    let mut rig = Rig::new(None);
    rig.request(secs(1), 1, "a", "echo:x");
    // Three messages reach the plane before the host runs any: the first
    // asks to passivate (the region's stop is queued behind the other
    // two), the second fails the incarnation, the third starts a new one.
    rig.batch(
        secs(2),
        "a",
        &[(2, "passivate"), (3, "bogus"), (4, "echo:y")],
    );
    assert_eq!(rig.reply_to(3).map(|r| r.0), Some(Status::EntityFailed));
    assert_eq!(rig.reply_to(4), Some((Status::Ok, b"y".to_vec())));
    let stops = |rig: &Rig| rig.log().iter().filter(|l| *l == "stop a").count();
    assert_eq!(
        stops(&rig),
        1,
        "only the failed incarnation: {:?}",
        rig.log()
    );
    assert_eq!(rig.active(), 1);
    assert_eq!(rig.region_entities(), vec!["a"]);
    // The next message goes to the same (second) incarnation.
    rig.request(secs(3), 5, "a", "echo:z");
    assert_eq!(rig.reply_to(5), Some((Status::Ok, b"z".to_vec())));
    assert_eq!(rig.host.figures(rig.ty).expect("type").activated, 2);
    // And a real passivation still stops it, once.
    rig.request(secs(4), 6, "a", "passivate");
    assert_eq!(stops(&rig), 2);
    assert_eq!(rig.active(), 0);
    assert!(rig.region_entities().is_empty());
}

#[test]
fn a_stale_stop_that_takes_the_next_incarnation_does_not_let_a_third_start_before_it_stopped() {
    let mut rig = Rig::new(None);
    rig.request(secs(1), 1, "a", "echo:x");
    // One drain: the first incarnation asks to stop (stop #1 queued), then
    // fails; the next message starts a second one, which asks to stop and
    // holds its stop (as one with appends in flight would): stop #1 takes
    // it, and stop #2 finds no incarnation running.
    rig.batch(
        secs(2),
        "a",
        &[(2, "passivate"), (3, "bogus"), (4, "keep-passivate")],
    );
    let starts = |rig: &Rig| rig.log().iter().filter(|l| *l == "start a").count();
    assert_eq!(starts(&rig), 2);
    assert_eq!(rig.region_entities(), vec!["a"], "the region waits for it");
    // A message now waits for that stop; no third incarnation runs beside
    // the stopping one.
    rig.request(secs(3), 5, "a", "echo:z");
    assert_eq!(starts(&rig), 2, "{:?}", rig.log());
    assert_eq!(rig.reply_to(5), None);
    // Once it stopped, the message starts the next incarnation, which the
    // region keeps (the stop report removed the stopped one only).
    rig.host.handle_drain_end(secs(4), &mut rig.plane);
    rig.run(secs(4));
    assert_eq!(rig.reply_to(5), Some((Status::Ok, b"z".to_vec())));
    assert_eq!(starts(&rig), 3);
    assert_eq!(rig.active(), 1);
    assert_eq!(rig.region_entities(), vec!["a"]);
    rig.request(secs(5), 6, "a", "echo:w");
    assert_eq!(rig.reply_to(6), Some((Status::Ok, b"w".to_vec())));
    assert_eq!(starts(&rig), 3, "the same incarnation");
}
