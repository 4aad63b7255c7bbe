//! What one connection observed: latency histograms, errors by kind,
//! per-second figures, unreachability windows and counter acknowledgements.
//!
//! All latencies are recorded in microseconds into HdrHistograms (3
//! significant digits for the run, 2 for each second), from the request's
//! intended send time (see [`crate::schedule`]).

use std::collections::{BTreeMap, HashMap};

use hdrhistogram::Histogram;
use serde::Serialize;

use crate::verify::AddCounts;
use crate::workload::OpKind;

/// Highest latency a histogram tracks (µs): one hour. Larger values are
/// recorded as this value.
pub const MAX_LATENCY_US: u64 = 3_600_000_000;
/// Longest run covered by per-second histograms (s); later seconds are not
/// broken down per second (they still count in the totals).
pub const MAX_SECONDS: usize = 24 * 3600;

/// A fresh latency histogram in µs with `sigfig` significant digits.
pub fn latency_histogram(sigfig: u8) -> Histogram<u64> {
    Histogram::new_with_bounds(1, MAX_LATENCY_US, sigfig)
        .expect("static histogram bounds are valid")
}

/// Why a request did not succeed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The node does not know the entity type.
    UnknownEntityType,
    /// The node refused the entity id.
    InvalidEntityId,
    /// The node's buffer for the entity or shard was full (request refused).
    BufferFull,
    /// The node gave up waiting for the entity (may have been applied).
    TimedOut,
    /// The entity failed while handling it (may have been applied).
    EntityFailed,
    /// The node is shutting down (request refused).
    ShuttingDown,
    /// The journal backend was unavailable (not applied, or unknown when
    /// the database went away during the commit).
    JournalUnavailable,
    /// Not delivered, safe to retry: home unreachable or removed, node
    /// leaving, or the ask deadline passed while buffered (not applied).
    Unavailable,
    /// The message is over the cluster's size limit (not applied).
    TooLarge,
    /// A status this harness does not know.
    OtherStatus,
    /// The entity answered `error: ...` (command rejected, not applied).
    EntityError,
    /// Status Ok but a reply payload the harness could not parse.
    BadReply,
    /// The connection broke while the request was in flight.
    ConnectionLost,
    /// No response within the request timeout.
    NoResponse,
}

impl ErrorKind {
    /// Whether a counter add that ended with this error may still have been
    /// applied (so the verifier cannot count it as lost or as not applied).
    pub fn maybe_applied(self) -> bool {
        matches!(
            self,
            ErrorKind::TimedOut
                | ErrorKind::EntityFailed
                | ErrorKind::OtherStatus
                | ErrorKind::BadReply
                | ErrorKind::ConnectionLost
                | ErrorKind::NoResponse
        )
    }

    /// The snake_case name used in reports.
    pub fn name(self) -> &'static str {
        match self {
            ErrorKind::UnknownEntityType => "unknown_entity_type",
            ErrorKind::InvalidEntityId => "invalid_entity_id",
            ErrorKind::BufferFull => "buffer_full",
            ErrorKind::TimedOut => "timed_out",
            ErrorKind::EntityFailed => "entity_failed",
            ErrorKind::ShuttingDown => "shutting_down",
            ErrorKind::JournalUnavailable => "journal_unavailable",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::TooLarge => "too_large",
            ErrorKind::OtherStatus => "other_status",
            ErrorKind::EntityError => "entity_error",
            ErrorKind::BadReply => "bad_reply",
            ErrorKind::ConnectionLost => "connection_lost",
            ErrorKind::NoResponse => "no_response",
        }
    }
}

/// Everything one connection (or, merged, the whole run) observed.
pub struct Recorder {
    /// Intended send time (ns since origin) from which results count in the
    /// summary; earlier ones are warm-up.
    pub measure_start_ns: u64,
    /// Successful requests after warm-up (µs).
    pub histogram: Histogram<u64>,
    /// Successes since the progress display last took it (µs).
    pub interval: Histogram<u64>,
    /// Successful requests per second of intended send time since origin
    /// (µs, 2 significant digits), warm-up included.
    pub per_second: Vec<Histogram<u64>>,
    /// Errors per second of intended send time since origin (count).
    pub errors_per_second: Vec<u64>,
    /// Successful requests after warm-up (count).
    pub ok: u64,
    /// Successful requests during warm-up (count).
    pub ok_warmup: u64,
    /// Failed requests after warm-up by kind (count).
    pub errors: BTreeMap<ErrorKind, u64>,
    /// Failed requests during warm-up (count).
    pub errors_warmup: u64,
    /// Counter adds per entity, warm-up included.
    pub adds: HashMap<u64, AddCounts>,
    /// Completion time of the last measured request (ns since origin).
    pub last_completion_ns: u64,
    /// Longest unreachability window seen (ns) and its entity and start.
    pub longest_unreachable: Option<Unreachable>,
    /// When `Some`, the last value read from each counter (by `get` or
    /// `add`), for the verifier.
    pub values: Option<HashMap<u64, i64>>,
    open_windows: HashMap<u64, u64>,
}

/// The longest time one entity could not be reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Unreachable {
    /// Entity number.
    pub entity: u64,
    /// When the window began (ns since origin): the intended send time of the
    /// first request that failed or waited.
    pub start_ns: u64,
    /// Length (ns): until a request to that entity next succeeded.
    pub length_ns: u64,
}

impl Recorder {
    /// An empty recorder; results of requests intended before
    /// `measure_start_ns` count as warm-up.
    pub fn new(measure_start_ns: u64) -> Recorder {
        Recorder {
            measure_start_ns,
            histogram: latency_histogram(3),
            interval: latency_histogram(2),
            per_second: Vec::new(),
            errors_per_second: Vec::new(),
            ok: 0,
            ok_warmup: 0,
            errors: BTreeMap::new(),
            errors_warmup: 0,
            adds: HashMap::new(),
            last_completion_ns: 0,
            longest_unreachable: None,
            values: None,
            open_windows: HashMap::new(),
        }
    }

    /// Keeps the value of every successful counter reply when `capture`.
    pub fn capturing_values(mut self, capture: bool) -> Recorder {
        self.values = capture.then(HashMap::new);
        self
    }

    fn note_window(&mut self, entity: u64, start_ns: u64, end_ns: u64) {
        let length_ns = end_ns.saturating_sub(start_ns);
        if self
            .longest_unreachable
            .is_none_or(|u| length_ns > u.length_ns)
        {
            self.longest_unreachable = Some(Unreachable {
                entity,
                start_ns,
                length_ns,
            });
        }
    }

    /// Records a successful request.
    pub fn success(&mut self, entity: u64, op: OpKind, intended_ns: u64, completed_ns: u64) {
        let latency_us = crate::schedule::latency_ns(intended_ns, completed_ns) / 1_000;
        let window_start = self
            .open_windows
            .remove(&entity)
            .unwrap_or(intended_ns)
            .min(intended_ns);
        self.note_window(entity, window_start, completed_ns);
        if op == OpKind::CounterAdd {
            self.adds.entry(entity).or_default().acked += 1;
        }
        let second = (intended_ns / 1_000_000_000) as usize;
        if second < MAX_SECONDS {
            if self.per_second.len() <= second {
                self.per_second
                    .resize_with(second + 1, || latency_histogram(2));
            }
            self.per_second[second].saturating_record(latency_us);
        }
        self.interval.saturating_record(latency_us);
        if intended_ns >= self.measure_start_ns {
            self.ok += 1;
            self.histogram.saturating_record(latency_us);
            self.last_completion_ns = self.last_completion_ns.max(completed_ns);
        } else {
            self.ok_warmup += 1;
        }
    }

    /// Records a failed request.
    pub fn failure(
        &mut self,
        entity: u64,
        op: OpKind,
        kind: ErrorKind,
        intended_ns: u64,
        completed_ns: u64,
    ) {
        self.open_windows.entry(entity).or_insert(intended_ns);
        if op == OpKind::CounterAdd {
            let counts = self.adds.entry(entity).or_default();
            if kind.maybe_applied() {
                counts.ambiguous += 1;
            } else {
                counts.refused += 1;
            }
        }
        let second = (intended_ns / 1_000_000_000) as usize;
        if second < MAX_SECONDS {
            if self.errors_per_second.len() <= second {
                self.errors_per_second.resize(second + 1, 0);
            }
            self.errors_per_second[second] += 1;
        }
        if intended_ns >= self.measure_start_ns {
            *self.errors.entry(kind).or_default() += 1;
            self.last_completion_ns = self.last_completion_ns.max(completed_ns);
        } else {
            self.errors_warmup += 1;
        }
    }

    /// Closes the windows still open at `end_ns` (entities whose last
    /// requests failed and that were never reached again).
    pub fn close_windows(&mut self, end_ns: u64) {
        let open: Vec<(u64, u64)> = self.open_windows.drain().collect();
        for (entity, start) in open {
            self.note_window(entity, start, end_ns);
        }
    }

    /// Errors after warm-up, all kinds (count).
    pub fn error_count(&self) -> u64 {
        self.errors.values().sum()
    }

    /// Adds everything `other` recorded into `self` (both must share the
    /// measurement start).
    pub fn merge(&mut self, other: Recorder) {
        self.histogram
            .add(&other.histogram)
            .expect("same histogram bounds");
        self.interval
            .add(&other.interval)
            .expect("same histogram bounds");
        if self.per_second.len() < other.per_second.len() {
            self.per_second
                .resize_with(other.per_second.len(), || latency_histogram(2));
        }
        for (mine, theirs) in self.per_second.iter_mut().zip(other.per_second.iter()) {
            mine.add(theirs).expect("same histogram bounds");
        }
        if self.errors_per_second.len() < other.errors_per_second.len() {
            self.errors_per_second
                .resize(other.errors_per_second.len(), 0);
        }
        for (mine, theirs) in self
            .errors_per_second
            .iter_mut()
            .zip(other.errors_per_second.iter())
        {
            *mine += theirs;
        }
        self.ok += other.ok;
        self.ok_warmup += other.ok_warmup;
        for (kind, n) in other.errors {
            *self.errors.entry(kind).or_default() += n;
        }
        self.errors_warmup += other.errors_warmup;
        for (entity, counts) in other.adds {
            let mine = self.adds.entry(entity).or_default();
            mine.acked += counts.acked;
            mine.ambiguous += counts.ambiguous;
            mine.refused += counts.refused;
        }
        self.last_completion_ns = self.last_completion_ns.max(other.last_completion_ns);
        if let Some(u) = other.longest_unreachable {
            self.note_window(u.entity, u.start_ns, u.start_ns + u.length_ns);
        }
        if let Some(theirs) = other.values {
            self.values.get_or_insert_with(HashMap::new).extend(theirs);
        }
        for (entity, start) in other.open_windows {
            let slot = self.open_windows.entry(entity).or_insert(start);
            *slot = (*slot).min(start);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    #[test]
    fn warmup_is_kept_out_of_the_summary() {
        let mut r = Recorder::new(2 * S);
        r.success(1, OpKind::Echo, S, S + 5_000_000);
        r.success(1, OpKind::Echo, 3 * S, 3 * S + 2_000_000);
        r.failure(2, OpKind::Echo, ErrorKind::BufferFull, S, S);
        r.failure(2, OpKind::Echo, ErrorKind::BufferFull, 3 * S, 3 * S);
        assert_eq!(
            (r.ok, r.ok_warmup, r.errors_warmup, r.error_count()),
            (1, 1, 1, 1)
        );
        assert_eq!(r.histogram.len(), 1);
        assert_eq!(r.histogram.max(), r.histogram.highest_equivalent(2_000));
        assert_eq!(r.per_second.len(), 4);
        assert_eq!(r.per_second[1].len(), 1);
        assert_eq!(r.errors_per_second, vec![0, 1, 0, 1]);
    }

    #[test]
    fn unreachability_spans_failures_until_next_success() {
        let mut r = Recorder::new(0);
        r.success(7, OpKind::Echo, S, S + 1_000);
        r.failure(
            7,
            OpKind::Echo,
            ErrorKind::ConnectionLost,
            2 * S,
            2 * S + 10,
        );
        r.failure(
            7,
            OpKind::Echo,
            ErrorKind::ConnectionLost,
            3 * S,
            3 * S + 10,
        );
        r.success(9, OpKind::Echo, 3 * S, 3 * S + 1_000);
        r.success(7, OpKind::Echo, 4 * S, 4 * S + 500_000_000);
        let u = r.longest_unreachable.unwrap();
        assert_eq!(
            (u.entity, u.start_ns, u.length_ns),
            (7, 2 * S, 2 * S + 500_000_000)
        );
        r.failure(8, OpKind::Echo, ErrorKind::NoResponse, 5 * S, 5 * S);
        r.close_windows(10 * S);
        assert_eq!(r.longest_unreachable.unwrap().entity, 8);
        assert_eq!(r.longest_unreachable.unwrap().length_ns, 5 * S);
    }

    #[test]
    fn adds_are_classified() {
        let mut r = Recorder::new(0);
        r.success(1, OpKind::CounterAdd, 0, 1);
        r.failure(1, OpKind::CounterAdd, ErrorKind::ConnectionLost, 0, 1);
        r.failure(1, OpKind::CounterAdd, ErrorKind::BufferFull, 0, 1);
        r.failure(1, OpKind::CounterAdd, ErrorKind::Unavailable, 0, 1);
        r.failure(1, OpKind::CounterAdd, ErrorKind::TooLarge, 0, 1);
        r.failure(1, OpKind::CounterAdd, ErrorKind::TimedOut, 0, 1);
        r.success(1, OpKind::CounterGet, 0, 1);
        let c = r.adds[&1];
        // Not delivered (buffer full, unavailable, too large) is refused;
        // timed out and a lost connection may have been applied.
        assert_eq!((c.acked, c.ambiguous, c.refused), (1, 2, 3));
        assert_eq!(r.errors[&ErrorKind::Unavailable], 1);
        assert_eq!(ErrorKind::Unavailable.name(), "unavailable");
    }

    #[test]
    fn merge_adds_everything() {
        let mut a = Recorder::new(0);
        let mut b = Recorder::new(0);
        a.success(1, OpKind::CounterAdd, 0, 1_000_000);
        b.success(2, OpKind::CounterAdd, 3 * S, 3 * S + 1_000_000);
        b.failure(2, OpKind::CounterAdd, ErrorKind::TimedOut, 3 * S, 3 * S);
        a.merge(b);
        assert_eq!(a.ok, 2);
        assert_eq!(a.histogram.len(), 2);
        assert_eq!(a.per_second.len(), 4);
        assert_eq!(a.errors[&ErrorKind::TimedOut], 1);
        assert_eq!(a.adds.len(), 2);
        assert_eq!(a.last_completion_ns, 3 * S + 1_000_000);
    }
}
