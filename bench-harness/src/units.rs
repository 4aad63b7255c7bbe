//! Parsing and printing of durations and latencies on the command line and in
//! reports.

use std::time::Duration;

/// Parses a duration such as `10s`, `500ms`, `2m`, `1h`, `250us` or a bare
/// number of seconds (`30`, `0.5`).
///
/// # Errors
/// A message naming the input when the number or the unit is not recognised.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("`{text}` is not a duration (examples: 10s, 500ms, 2m)"))?;
    let seconds = match unit.trim() {
        "" | "s" => value,
        "ms" => value / 1e3,
        "us" | "µs" => value / 1e6,
        "ns" => value / 1e9,
        "m" | "min" => value * 60.0,
        "h" => value * 3600.0,
        other => {
            return Err(format!(
                "unknown duration unit `{other}` in `{text}` (use ns, us, ms, s, m, h)"
            ))
        }
    };
    if !(0.0..=1e9).contains(&seconds) {
        return Err(format!("duration `{text}` is out of range"));
    }
    Ok(Duration::from_secs_f64(seconds))
}

/// Formats a latency given in microseconds with a unit that keeps 3–4
/// significant digits readable: `850 us`, `1.234 ms`, `2.500 s`.
pub fn format_latency_us(us: u64) -> String {
    if us < 1_000 {
        format!("{us} us")
    } else if us < 1_000_000 {
        format!("{:.3} ms", us as f64 / 1e3)
    } else {
        format!("{:.3} s", us as f64 / 1e6)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_with_units() {
        assert_eq!(parse_duration("10s").unwrap(), Duration::from_secs(10));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("1h").unwrap(), Duration::from_secs(3600));
        assert_eq!(parse_duration("250us").unwrap(), Duration::from_micros(250));
        assert_eq!(parse_duration("7").unwrap(), Duration::from_secs(7));
        assert_eq!(parse_duration("0.5").unwrap(), Duration::from_millis(500));
    }

    #[test]
    fn bad_durations_are_refused() {
        assert!(parse_duration("ten seconds").is_err());
        assert!(parse_duration("10 parsecs").is_err());
        assert!(parse_duration("").is_err());
    }

    #[test]
    fn latencies_print_with_units() {
        assert_eq!(format_latency_us(850), "850 us");
        assert_eq!(format_latency_us(1_234), "1.234 ms");
        assert_eq!(format_latency_us(2_500_000), "2.500 s");
    }
}
