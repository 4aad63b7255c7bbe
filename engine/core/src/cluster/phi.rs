//! The phi accrual failure detector.
//!
//! Hayashibara, Défago, Yared, Katayama, "The φ Accrual Failure Detector",
//! SRDS 2004, as configured in Akka (`akka.remote.PhiAccrualFailureDetector`
//! and `akka.cluster.failure-detector`):
//!
//! * the detector keeps the last `max_sample_size` inter-arrival times of
//!   heartbeats and their mean μ and standard deviation σ;
//! * `phi(t) = -log10(1 - F(t))` where `t` is the time since the last
//!   heartbeat and `F` the normal CDF with mean `μ + acceptable_heartbeat_pause`
//!   and standard deviation `max(σ, min_std_deviation)`;
//! * `F` is computed with the logistic approximation of the normal CDF used
//!   by Akka: `y = (t - mean) / sd`, `e = exp(-y (1.5976 + 0.070566 y²))`,
//!   `phi = -log10(e / (1 + e))` when `t > mean`, else
//!   `-log10(1 - 1 / (1 + e))`;
//! * the history starts from `first_heartbeat_estimate` (two samples at
//!   `estimate ± estimate/4`); an interval that ends a period in which the
//!   resource was unavailable is not recorded (a long pause would skew it).

use std::collections::VecDeque;
use std::time::Duration;

/// Settings of [`PhiAccrualFailureDetector`] (Akka's defaults for the
/// cluster failure detector).
#[derive(Debug, Clone, PartialEq)]
pub struct PhiConfig {
    /// Phi above which the resource is considered unavailable. Default 8.0.
    pub threshold: f64,
    /// Number of inter-arrival samples kept (count). Default 1000.
    pub max_sample_size: usize,
    /// Lower bound of the standard deviation. Default 100 ms.
    pub min_std_deviation: Duration,
    /// Silence tolerated on top of the mean interval. Default 3 s.
    pub acceptable_heartbeat_pause: Duration,
    /// Expected interval before any has been measured. Default 1 s.
    pub first_heartbeat_estimate: Duration,
}

impl Default for PhiConfig {
    fn default() -> Self {
        Self {
            threshold: 8.0,
            max_sample_size: 1000,
            min_std_deviation: Duration::from_millis(100),
            acceptable_heartbeat_pause: Duration::from_secs(3),
            first_heartbeat_estimate: Duration::from_secs(1),
        }
    }
}

/// Bounded history of heartbeat inter-arrival times, in milliseconds.
#[derive(Debug, Clone)]
struct HeartbeatHistory {
    max_sample_size: usize,
    intervals_ms: VecDeque<f64>,
    sum_ms: f64,
    squared_sum_ms: f64,
}

impl HeartbeatHistory {
    fn new(max_sample_size: usize) -> Self {
        Self {
            max_sample_size: max_sample_size.max(1),
            intervals_ms: VecDeque::new(),
            sum_ms: 0.0,
            squared_sum_ms: 0.0,
        }
    }

    fn push(&mut self, interval_ms: f64) {
        if self.intervals_ms.len() >= self.max_sample_size {
            if let Some(old) = self.intervals_ms.pop_front() {
                self.sum_ms -= old;
                self.squared_sum_ms -= old * old;
            }
        }
        self.intervals_ms.push_back(interval_ms);
        self.sum_ms += interval_ms;
        self.squared_sum_ms += interval_ms * interval_ms;
    }

    fn mean_ms(&self) -> f64 {
        self.sum_ms / self.intervals_ms.len().max(1) as f64
    }

    fn std_deviation_ms(&self) -> f64 {
        let n = self.intervals_ms.len().max(1) as f64;
        let mean = self.mean_ms();
        (self.squared_sum_ms / n - mean * mean).max(0.0).sqrt()
    }
}

/// One phi accrual failure detector for one monitored resource (member).
#[derive(Debug, Clone)]
pub struct PhiAccrualFailureDetector {
    config: PhiConfig,
    history: HeartbeatHistory,
    last_heartbeat: Option<Duration>,
}

impl PhiAccrualFailureDetector {
    /// A detector that has not yet seen a heartbeat (it reports phi 0 and
    /// available until the first one).
    pub fn new(config: PhiConfig) -> Self {
        let history = HeartbeatHistory::new(config.max_sample_size);
        Self {
            config,
            history,
            last_heartbeat: None,
        }
    }

    /// Whether at least one heartbeat was recorded.
    pub fn is_monitoring(&self) -> bool {
        self.last_heartbeat.is_some()
    }

    /// Records a heartbeat that arrived at `now`.
    pub fn heartbeat(&mut self, now: Duration) {
        match self.last_heartbeat {
            None => {
                let est = ms(self.config.first_heartbeat_estimate);
                let sd = est / 4.0;
                self.history.push(est - sd);
                self.history.push(est + sd);
            }
            Some(last) => {
                if now >= last && self.is_available(now) {
                    self.history.push(ms(now - last));
                }
            }
        }
        if self.last_heartbeat.is_none_or(|l| now > l) {
            self.last_heartbeat = Some(now);
        }
    }

    /// The suspicion level at `now` (0.0 before the first heartbeat).
    pub fn phi(&self, now: Duration) -> f64 {
        let Some(last) = self.last_heartbeat else {
            return 0.0;
        };
        let time_diff_ms = ms(now.saturating_sub(last));
        let mean_ms = self.history.mean_ms() + ms(self.config.acceptable_heartbeat_pause);
        let sd_ms = self
            .history
            .std_deviation_ms()
            .max(ms(self.config.min_std_deviation));
        phi(time_diff_ms, mean_ms, sd_ms)
    }

    /// Whether the resource is available at `now`: `phi(now) < threshold`.
    pub fn is_available(&self, now: Duration) -> bool {
        self.phi(now) < self.config.threshold
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Akka's phi for a time since the last heartbeat, a mean and a standard
/// deviation (all in milliseconds), with the logistic approximation of the
/// normal CDF (see the module doc).
pub fn phi(time_diff_ms: f64, mean_ms: f64, std_deviation_ms: f64) -> f64 {
    let y = (time_diff_ms - mean_ms) / std_deviation_ms;
    let e = (-y * (1.5976 + 0.070566 * y * y)).exp();
    if time_diff_ms > mean_ms {
        -(e / (1.0 + e)).log10()
    } else {
        -(1.0 - 1.0 / (1.0 + e)).log10()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn s(ms: u64) -> Duration {
        Duration::from_millis(ms)
    }

    #[test]
    fn known_values_of_the_formula() {
        // The table of Akka's AccrualFailureDetectorSpec ("realistic phi
        // values"): mean 1000 ms, standard deviation 100 ms.
        for (t, want) in [
            (0.0, 0.0),
            (500.0, 0.1),
            (1000.0, 0.3),
            (1200.0, 1.6),
            (1400.0, 4.7),
            (1600.0, 10.8),
            (1700.0, 15.3),
        ] {
            let got = phi(t, 1000.0, 100.0);
            assert!((got - want).abs() < 0.1, "phi({t}) = {got}, want {want}");
        }
    }

    #[test]
    fn phi_is_zero_before_the_first_heartbeat() {
        let fd = PhiAccrualFailureDetector::new(PhiConfig::default());
        assert_eq!(fd.phi(s(100_000)), 0.0);
        assert!(fd.is_available(s(100_000)));
    }

    #[test]
    fn known_value_for_a_steady_history() {
        // Heartbeats exactly every 1000 ms: mean 1000, sd below the minimum
        // so 100 ms; with a 3 s pause the mean becomes 4000 ms.
        let mut fd = PhiAccrualFailureDetector::new(PhiConfig {
            max_sample_size: 10,
            ..PhiConfig::default()
        });
        for i in 0..=20 {
            fd.heartbeat(s(i * 1000));
        }
        let last = s(20_000);
        assert!((fd.phi(last + s(4000)) - phi(4000.0, 4000.0, 100.0)).abs() < 1e-9);
        assert!((fd.phi(last + s(4000)) - 0.3).abs() < 0.1);
        assert!(fd.is_available(last + s(4400)));
        // phi 8 is crossed between 4.5 s and 4.6 s of silence.
        assert!(!fd.is_available(last + s(4600)));
    }

    #[test]
    fn no_interval_recorded_after_unavailability() {
        let mut fd = PhiAccrualFailureDetector::new(PhiConfig::default());
        for i in 0..10 {
            fd.heartbeat(s(i * 1000));
        }
        let before = fd.history.intervals_ms.len();
        fd.heartbeat(s(9_000 + 60_000));
        assert_eq!(fd.history.intervals_ms.len(), before);
    }

    #[test]
    fn history_is_bounded() {
        let mut fd = PhiAccrualFailureDetector::new(PhiConfig {
            max_sample_size: 5,
            ..PhiConfig::default()
        });
        for i in 0..100 {
            fd.heartbeat(s(i * 1000));
        }
        assert_eq!(fd.history.intervals_ms.len(), 5);
        assert!((fd.history.mean_ms() - 1000.0).abs() < 1e-6);
    }

    proptest! {
        #[test]
        fn phi_grows_with_silence(gaps in proptest::collection::vec(500u64..1500, 1..50),
                                  a in 0u64..20_000, b in 0u64..20_000) {
            let mut fd = PhiAccrualFailureDetector::new(PhiConfig::default());
            let mut t = 0;
            fd.heartbeat(s(t));
            for g in gaps { t += g; fd.heartbeat(s(t)); }
            let (lo, hi) = if a <= b { (a, b) } else { (b, a) };
            prop_assert!(fd.phi(s(t + lo)) <= fd.phi(s(t + hi)));
        }

        #[test]
        fn steady_heartbeat_with_jitter_never_crosses(jitter in proptest::collection::vec(0u64..2000, 1..300)) {
            // Heartbeats every 1 s, each delayed by up to 2 s (less than the
            // 3 s acceptable pause): phi stays under 8 at every moment.
            let fd_cfg = PhiConfig::default();
            let mut fd = PhiAccrualFailureDetector::new(fd_cfg.clone());
            let mut arrivals: Vec<u64> = jitter.iter().enumerate().map(|(i, j)| i as u64 * 1000 + j).collect();
            arrivals.sort_unstable();
            let mut last = 0;
            for at in arrivals {
                // check just before this arrival (the worst moment of the silence)
                if fd.is_monitoring() {
                    prop_assert!(fd.phi(s(at)) < fd_cfg.threshold, "phi {} at {}", fd.phi(s(at)), at);
                }
                fd.heartbeat(s(at));
                last = at;
            }
            prop_assert!(fd.is_available(s(last + 3000)));
        }
    }
}
