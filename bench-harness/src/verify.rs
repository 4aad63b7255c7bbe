//! The counter verifier: after the load, every counter that was sent an
//! `add 1` is read back and compared with what the harness was told.
//!
//! For one entity with `acked` acknowledged adds, `ambiguous` adds whose
//! outcome is unknown (connection lost, timed out, no response: they may or
//! may not have been applied) and a value `v` read at the end (minus the
//! value read before the run, if any):
//! - `v < acked`: `acked - v` acknowledged adds were **lost**;
//! - `v > acked + ambiguous`: `v - acked - ambiguous` adds were
//!   **duplicated** (applied more often than sent);
//! - anything in between is consistent with at-most-once delivery.
//!
//! Adds refused with a definite error (buffer full, unknown type, entity
//! error, shutting down, unavailable — not delivered, e.g. its ask deadline
//! passed while it was buffered —, too large) are counted as not applied,
//! so an engine that applied one shows up as duplicated. Only `timed_out`
//! (the engine's "may have reached its entity") and the client-side
//! failures count as unknown.

use std::collections::HashMap;

use serde::Serialize;

/// Outcomes of the counter adds sent to one entity (counts).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct AddCounts {
    /// Adds answered with the new value.
    pub acked: u64,
    /// Adds whose outcome is unknown.
    pub ambiguous: u64,
    /// Adds refused with a definite error.
    pub refused: u64,
}

/// The verifier's result.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Verdict {
    /// Entities checked (count).
    pub entities: u64,
    /// Acknowledged adds missing from the final values (count of adds).
    pub lost: u64,
    /// Adds applied beyond what was sent (count of adds).
    pub duplicated: u64,
    /// Entities with lost adds (count).
    pub lost_entities: u64,
    /// Entities with duplicated adds (count).
    pub duplicated_entities: u64,
    /// Entities whose final value could not be read (count).
    pub unreadable: u64,
    /// Adds whose outcome was unknown, summed (count).
    pub ambiguous: u64,
}

impl Verdict {
    /// Whether the run showed no loss, no duplicate and read every counter.
    pub fn passed(&self) -> bool {
        self.lost == 0 && self.duplicated == 0 && self.unreadable == 0
    }

    /// The one-line summary `verify: N entities, L lost, D duplicated`, with
    /// the unreadable and ambiguous counts appended when non-zero.
    pub fn line(&self) -> String {
        let mut line = format!(
            "verify: {} entities, {} lost, {} duplicated",
            self.entities, self.lost, self.duplicated
        );
        if self.unreadable > 0 {
            line.push_str(&format!(", {} unreadable", self.unreadable));
        }
        if self.ambiguous > 0 {
            line.push_str(&format!(
                " ({} adds of unknown outcome allowed either way)",
                self.ambiguous
            ));
        }
        line
    }
}

/// Judges the final values.
///
/// `expected` holds the add outcomes per entity, `baseline` the values read
/// before the run (missing = 0), `observed` the values read after it
/// (`None` = could not be read).
pub fn judge(
    expected: &HashMap<u64, AddCounts>,
    baseline: &HashMap<u64, i64>,
    observed: &HashMap<u64, Option<i64>>,
) -> Verdict {
    let mut verdict = Verdict::default();
    for (entity, counts) in expected {
        verdict.entities += 1;
        verdict.ambiguous += counts.ambiguous;
        let Some(Some(value)) = observed.get(entity) else {
            verdict.unreadable += 1;
            continue;
        };
        let applied = value - baseline.get(entity).copied().unwrap_or(0);
        let acked = counts.acked as i64;
        let most = acked + counts.ambiguous as i64;
        if applied < acked {
            verdict.lost += (acked - applied) as u64;
            verdict.lost_entities += 1;
        } else if applied > most {
            verdict.duplicated += (applied - most) as u64;
            verdict.duplicated_entities += 1;
        }
    }
    verdict
}

/// Parses a counter reply (ASCII decimal i64).
pub fn parse_counter_value(payload: &[u8]) -> Option<i64> {
    std::str::from_utf8(payload).ok()?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(acked: u64, ambiguous: u64) -> AddCounts {
        AddCounts {
            acked,
            ambiguous,
            refused: 0,
        }
    }

    #[test]
    fn exact_values_pass() {
        let expected = HashMap::from([(1, counts(3, 0)), (2, counts(1, 0))]);
        let observed = HashMap::from([(1, Some(3)), (2, Some(1))]);
        let v = judge(&expected, &HashMap::new(), &observed);
        assert!(v.passed());
        assert_eq!(v.line(), "verify: 2 entities, 0 lost, 0 duplicated");
    }

    #[test]
    fn loss_and_duplication_are_counted_in_adds() {
        let expected = HashMap::from([(1, counts(5, 0)), (2, counts(2, 1)), (3, counts(2, 1))]);
        let observed = HashMap::from([(1, Some(3)), (2, Some(5)), (3, Some(3))]);
        let v = judge(&expected, &HashMap::new(), &observed);
        assert_eq!(
            (v.lost, v.lost_entities, v.duplicated, v.duplicated_entities),
            (2, 1, 2, 1)
        );
        assert!(!v.passed());
        assert!(v
            .line()
            .starts_with("verify: 3 entities, 2 lost, 2 duplicated"));
    }

    #[test]
    fn ambiguous_adds_may_go_either_way_and_baseline_is_subtracted() {
        let expected = HashMap::from([(1, counts(2, 2))]);
        for value in 12..=14 {
            let observed = HashMap::from([(1, Some(value))]);
            let v = judge(&expected, &HashMap::from([(1, 10)]), &observed);
            assert!(v.passed(), "{value}");
        }
    }

    #[test]
    fn unreadable_counters_fail_the_check() {
        let expected = HashMap::from([(1, counts(1, 0)), (2, counts(1, 0))]);
        let observed = HashMap::from([(1, Some(1)), (2, None)]);
        let v = judge(&expected, &HashMap::new(), &observed);
        assert_eq!(v.unreadable, 2 - 1);
        assert!(!v.passed());
    }

    #[test]
    fn counter_replies_parse() {
        assert_eq!(parse_counter_value(b"42"), Some(42));
        assert_eq!(parse_counter_value(b"-7\n"), Some(-7));
        assert_eq!(parse_counter_value(b"error: bad"), None);
    }
}
