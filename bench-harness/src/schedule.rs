//! The open-loop scheduler's arithmetic.
//!
//! In an open loop, request `i` of a connection has an intended send time
//! `start + i / rate`, fixed before the run, whatever the server does. Its
//! latency is measured from that intended time, not from when the harness
//! actually managed to send it: when the server stalls, the requests that
//! should have gone out during the stall are charged the time they waited.
//! This is the correction for coordinated omission described by Gil Tene
//! ("How NOT to Measure Latency", and HdrHistogram's documentation of
//! `recordValueWithExpectedInterval`), done here at the source by timing
//! from the schedule.

/// The fixed send schedule of one open-loop stream.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OpenLoopSchedule {
    /// Intended send time of request 0, ns since the run's origin.
    pub start_ns: u64,
    /// Requests per second of this stream (> 0).
    pub rate_per_s: f64,
}

impl OpenLoopSchedule {
    /// A schedule starting at `start_ns` with `rate_per_s` requests per
    /// second.
    ///
    /// # Panics
    /// If `rate_per_s` is not a positive finite number.
    pub fn new(start_ns: u64, rate_per_s: f64) -> OpenLoopSchedule {
        assert!(
            rate_per_s.is_finite() && rate_per_s > 0.0,
            "rate must be positive, got {rate_per_s}"
        );
        OpenLoopSchedule {
            start_ns,
            rate_per_s,
        }
    }

    /// Intended send time of request `index` (ns since origin):
    /// `start + index * 1e9 / rate`, rounded to the nearest ns.
    pub fn send_time_ns(&self, index: u64) -> u64 {
        self.start_ns
            .saturating_add((index as f64 * 1e9 / self.rate_per_s).round() as u64)
    }

    /// How many requests are due at `now_ns` (those with an intended send
    /// time `<= now_ns`).
    pub fn due_at(&self, now_ns: u64) -> u64 {
        if now_ns < self.start_ns {
            return 0;
        }
        let mut n = ((now_ns - self.start_ns) as f64 * self.rate_per_s / 1e9).floor() as u64 + 1;
        // Correct the float estimate against the exact send times.
        while n > 0 && self.send_time_ns(n - 1) > now_ns {
            n -= 1;
        }
        while self.send_time_ns(n) <= now_ns {
            n += 1;
        }
        n
    }

    /// Number of requests whose intended send time falls before `end_ns`.
    pub fn count_before(&self, end_ns: u64) -> u64 {
        if end_ns == 0 {
            return 0;
        }
        self.due_at(end_ns - 1)
    }
}

/// Latency of a request (ns) from its intended send time to the moment its
/// response was read; 0 if the clock reads earlier.
pub fn latency_ns(intended_send_ns: u64, completed_ns: u64) -> u64 {
    completed_ns.saturating_sub(intended_send_ns)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn send_times_are_evenly_spaced() {
        let s = OpenLoopSchedule::new(1_000, 1000.0);
        assert_eq!(s.send_time_ns(0), 1_000);
        assert_eq!(s.send_time_ns(1), 1_001_000);
        assert_eq!(s.send_time_ns(1000), 1_000_001_000);
        let third = OpenLoopSchedule::new(0, 3.0);
        assert_eq!(third.send_time_ns(1), 333_333_333);
        assert_eq!(third.send_time_ns(3), 1_000_000_000);
    }

    #[test]
    fn due_counts_match_send_times() {
        let s = OpenLoopSchedule::new(500, 7.0);
        assert_eq!(s.due_at(0), 0);
        assert_eq!(s.due_at(499), 0);
        assert_eq!(s.due_at(500), 1);
        for i in 0..100 {
            let t = s.send_time_ns(i);
            assert_eq!(s.due_at(t), i + 1);
            assert_eq!(s.due_at(t - 1), i);
        }
    }

    #[test]
    fn duration_holds_rate_times_duration_requests() {
        let s = OpenLoopSchedule::new(0, 1000.0);
        assert_eq!(s.count_before(1_000_000_000), 1000);
        let s = OpenLoopSchedule::new(2_000_000_000, 250.0);
        assert_eq!(s.count_before(2_000_000_000 + 10_000_000_000), 2500);
        assert_eq!(s.count_before(0), 0);
    }

    #[test]
    fn a_stall_is_charged_to_every_request_scheduled_during_it() {
        // 1000/s; the server answers nothing between 10 ms and 110 ms, then all
        // at once at 110 ms. The requests scheduled at 10, 11, ..., 109 ms each
        // waited from their own intended time, so latencies run from 100 ms
        // down to 1 ms rather than one 100 ms outlier and 99 fast ones.
        let s = OpenLoopSchedule::new(0, 1000.0);
        let done = 110_000_000;
        let latencies: Vec<u64> = (10..110)
            .map(|i| latency_ns(s.send_time_ns(i), done))
            .collect();
        assert_eq!(latencies[0], 100_000_000);
        assert_eq!(latencies[99], 1_000_000);
        assert_eq!(latencies.iter().filter(|&&l| l >= 50_000_000).count(), 51);
        assert_eq!(latency_ns(10, 5), 0);
    }

    #[test]
    #[should_panic(expected = "rate must be positive")]
    fn zero_rate_is_refused() {
        let _ = OpenLoopSchedule::new(0, 0.0);
    }
}
