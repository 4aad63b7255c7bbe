//! Rate limits for log lines that a remote peer can cause at will: one
//! line per window and site, then a count of what was held back.
//!
//! A load balancer's TCP health check aimed at the cluster port, a port
//! scanner or a client speaking the wrong protocol would otherwise write
//! one WARN line per connection, and an `accept` failing with `EMFILE`
//! one per retry (100 a second): the log would drown what matters and
//! fill the disk. Each site keeps a [`LogLimit`] in a `static`; it is
//! shared by every executor of the process (atomics, no lock).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The window of the engine's limited log sites: one line per site per
/// 10 s (in ms).
pub const LOG_WINDOW_MS: u64 = 10_000;

/// The process's clock origin for [`LogLimit`] windows.
fn origin() -> Instant {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    *ORIGIN.get_or_init(Instant::now)
}

/// One log site's limit: at most one line per `window`. Lines in between
/// are counted; the next line allowed says how many were held back.
#[derive(Debug)]
pub struct LogLimit {
    /// Window length, in ms.
    window_ms: u64,
    /// When the last allowed line was written, in ms since [`origin`]
    /// plus one (0: never).
    last_ms: AtomicU64,
    /// Lines held back since then (count).
    held: AtomicU64,
}

impl LogLimit {
    /// A limit of one line per `window_ms` milliseconds.
    pub const fn new(window_ms: u64) -> Self {
        LogLimit {
            window_ms,
            last_ms: AtomicU64::new(0),
            held: AtomicU64::new(0),
        }
    }

    /// Whether to write a line now: `Some(n)` with the number of lines
    /// held back since the last one written (write it, and say `n` when it
    /// is not 0), `None` when a line was written less than a window ago
    /// (this one is counted and held back).
    pub fn allow(&self) -> Option<u64> {
        self.allow_at(origin().elapsed())
    }

    /// [`LogLimit::allow`] at `now`, the time since the process's clock
    /// origin (for tests).
    fn allow_at(&self, now: Duration) -> Option<u64> {
        let now_ms = u64::try_from(now.as_millis()).unwrap_or(u64::MAX - 1) + 1;
        let last = self.last_ms.load(Ordering::Relaxed);
        if last != 0 && now_ms.saturating_sub(last) < self.window_ms {
            self.held.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        // One winner per window when executors race.
        if self
            .last_ms
            .compare_exchange(last, now_ms, Ordering::Relaxed, Ordering::Relaxed)
            .is_err()
        {
            self.held.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        Some(self.held.swap(0, Ordering::Relaxed))
    }
}

/// Writes a `tracing` event at `level`, at most one per
/// [`LOG_WINDOW_MS`] for this call site (each use declares its own
/// [`LogLimit`]), adding `held_back = n` when lines were held back since
/// the last one written. The fields and message are `tracing`'s.
macro_rules! limited {
    ($level:ident, $($rest:tt)+) => {{
        static LIMIT: $crate::runtime::log_limit::LogLimit =
            $crate::runtime::log_limit::LogLimit::new($crate::runtime::log_limit::LOG_WINDOW_MS);
        if let Some(held_back) = LIMIT.allow() {
            if held_back == 0 {
                tracing::$level!($($rest)+);
            } else {
                tracing::$level!(held_back, $($rest)+);
            }
        }
    }};
}
pub(crate) use limited;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_window_then_the_count_held_back() {
        let l = LogLimit::new(1_000);
        let at = Duration::from_millis;
        assert_eq!(l.allow_at(at(0)), Some(0));
        assert_eq!(l.allow_at(at(10)), None);
        assert_eq!(l.allow_at(at(999)), None);
        assert_eq!(l.allow_at(at(1_000)), Some(2));
        assert_eq!(l.allow_at(at(1_500)), None);
        assert_eq!(l.allow_at(at(5_000)), Some(1));
        assert_eq!(l.allow_at(at(6_000)), Some(0));
    }
}
