//! Durations as people type them: `30s`, `500ms`, `2m`, `1h`, `1.5s`.

use std::time::Duration;

/// Splits `12.5ms` into (`12.5`, `ms`), trimming spaces around both.
pub fn number_and_unit(text: &str) -> (&str, &str) {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    (num, unit.trim())
}

/// The longest duration accepted anywhere (ten years): long enough for any
/// session or retention, short enough that it fits u64 nanoseconds and can
/// be added to any instant.
pub const MAX: Duration = Duration::from_secs(3650 * 86400);

/// Parses `<number><unit>` with unit `ns`, `us`, `ms`, `s`, `m`, `h` or `d`; a bare
/// number is seconds. At most [`MAX`].
pub fn parse(text: &str) -> Result<Duration, String> {
    let (num, unit) = number_and_unit(text);
    let value: f64 = num
        .parse()
        .map_err(|_| format!("{text:?} is not a duration: use e.g. 30s, 500ms, 2m"))?;
    let scale = match unit {
        "ns" => 1e-9,
        "us" => 1e-6,
        "ms" => 1e-3,
        "" | "s" => 1.0,
        "m" => 60.0,
        "h" => 3600.0,
        "d" => 86400.0,
        _ => {
            return Err(format!(
                "unknown unit {unit:?} in {text:?}: use ns, us, ms, s, m, h or d"
            ))
        }
    };
    let secs = value * scale;
    if !secs.is_finite() || secs < 0.0 {
        return Err(format!("{text:?} is not a duration"));
    }
    if secs > MAX.as_secs_f64() {
        return Err(format!("{text:?} is too long: at most 3650d (ten years)"));
    }
    Ok(Duration::from_secs_f64(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units() {
        assert_eq!(parse("30s").unwrap(), Duration::from_secs(30));
        assert_eq!(parse("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse("1.5").unwrap(), Duration::from_millis(1500));
        assert!(parse("fast").unwrap_err().contains("30s"));
        assert_eq!(parse("7d").unwrap(), Duration::from_secs(7 * 86400));
        assert!(parse("3w").unwrap_err().contains("unit"));
    }

    #[test]
    fn huge_durations_are_an_error_not_a_panic() {
        for text in ["99999999999999999999s", "3651d", "9999999999999999999999999h"] {
            let e = parse(text).unwrap_err();
            assert!(
                e.contains("at most 3650d") || e.contains("not a duration"),
                "{text}: {e}"
            );
        }
        assert_eq!(parse("3650d").unwrap(), MAX);
    }
}
