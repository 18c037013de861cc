//! `%START_TIME%` and `%START_TIME(format)%`: Envoy's strftime with its sub-second
//! extensions, in UTC (Envoy's access-log time zone). Without a format Envoy writes
//! `2026-12-07T21:08:30.123Z` (`%Y-%m-%dT%H:%M:%E3SZ`).

use std::fmt::Write as _;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// One piece of a time format.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Piece {
    Text(String),
    Year,
    Year2,
    Month,
    Day,
    DayOfYear,
    Hour,
    Minute,
    Second,
    /// Seconds with N fractional digits (`%E3S`).
    SecondFrac(u8),
    /// N fractional digits alone (`%3f`; `%f` is 9).
    Frac(u8),
    Epoch,
    /// `+0000`
    Offset,
    /// `UTC`
    Zone,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TimeFormat(Vec<Piece>);

impl TimeFormat {
    /// The specifiers supported: `%Y %y %m %d %j %H %M %S %s %z %Z %T %F %f %Nf %ENS %%`.
    pub fn parse(f: &str) -> Result<TimeFormat, String> {
        let mut out = Vec::new();
        let mut text = String::new();
        let mut chars = f.chars().peekable();
        while let Some(c) = chars.next() {
            if c != '%' {
                text.push(c);
                continue;
            }
            let mut digits = None;
            let mut e = false;
            if chars.peek() == Some(&'E') {
                chars.next();
                e = true;
            }
            if let Some(d) = chars.peek().and_then(|c| c.to_digit(10)) {
                chars.next();
                digits = Some(d as u8);
            }
            let spec = chars.next().ok_or("START_TIME: the format ends with '%'")?;
            let piece = match (e, digits, spec) {
                (false, None, '%') => {
                    text.push('%');
                    continue;
                }
                (false, None, 'Y') => Piece::Year,
                (false, None, 'y') => Piece::Year2,
                (false, None, 'm') => Piece::Month,
                (false, None, 'd') => Piece::Day,
                (false, None, 'j') => Piece::DayOfYear,
                (false, None, 'H') => Piece::Hour,
                (false, None, 'M') => Piece::Minute,
                (false, None, 'S') => Piece::Second,
                (false, None, 's') => Piece::Epoch,
                (false, None, 'z') => Piece::Offset,
                (false, None, 'Z') => Piece::Zone,
                (false, None, 'f') => Piece::Frac(9),
                (false, Some(n @ 1..=9), 'f') => Piece::Frac(n),
                (true, Some(n @ 1..=9), 'S') => Piece::SecondFrac(n),
                (false, None, 'T') => {
                    out.extend(flush(&mut text));
                    out.extend([
                        Piece::Hour,
                        Piece::Text(":".into()),
                        Piece::Minute,
                        Piece::Text(":".into()),
                        Piece::Second,
                    ]);
                    continue;
                }
                (false, None, 'F') => {
                    out.extend(flush(&mut text));
                    out.extend([
                        Piece::Year,
                        Piece::Text("-".into()),
                        Piece::Month,
                        Piece::Text("-".into()),
                        Piece::Day,
                    ]);
                    continue;
                }
                _ => {
                    return Err(format!(
                        "START_TIME: %{}{}{spec} is not supported (%Y %y %m %d %j %H %M %S %s %z %Z %T %F %f %Nf %ENS %%)",
                        if e { "E" } else { "" },
                        digits.map(|d| d.to_string()).unwrap_or_default()
                    ))
                }
            };
            out.extend(flush(&mut text));
            out.push(piece);
        }
        out.extend(flush(&mut text));
        Ok(TimeFormat(out))
    }
}

fn flush(text: &mut String) -> Option<Piece> {
    (!text.is_empty()).then(|| Piece::Text(std::mem::take(text)))
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian (Howard Hinnant's
/// `civil_from_days`).
fn civil(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = (if mp < 10 { mp + 3 } else { mp - 9 }) as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

fn is_leap(y: i64) -> bool {
    y % 4 == 0 && (y % 100 != 0 || y % 400 == 0)
}

fn day_of_year(y: i64, m: u32, d: u32) -> u32 {
    const BEFORE: [u32; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    BEFORE[(m as usize - 1) % 12] + d + u32::from(m > 2 && is_leap(y))
}

/// `t` in `f`, or Envoy's default.
pub fn format(t: SystemTime, f: Option<&TimeFormat>) -> String {
    // A clock before 1970 is 1970.
    let since = t.duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO);
    let secs = since.as_secs() as i64;
    let nanos = since.subsec_nanos();
    let (y, m, d) = civil(secs.div_euclid(86_400));
    let sod = secs.rem_euclid(86_400);
    let (hh, mm, ss) = (sod / 3600, sod % 3600 / 60, sod % 60);
    let frac = |n: u8| {
        let s = format!("{nanos:09}");
        s[..usize::from(n).min(9)].to_string()
    };
    let mut out = String::with_capacity(32);
    let Some(f) = f else {
        let _ = write!(
            out,
            "{y:04}-{m:02}-{d:02}T{hh:02}:{mm:02}:{ss:02}.{}Z",
            frac(3)
        );
        return out;
    };
    for p in &f.0 {
        let _ = match p {
            Piece::Text(t) => write!(out, "{t}"),
            Piece::Year => write!(out, "{y:04}"),
            Piece::Year2 => write!(out, "{:02}", y.rem_euclid(100)),
            Piece::Month => write!(out, "{m:02}"),
            Piece::Day => write!(out, "{d:02}"),
            Piece::DayOfYear => write!(out, "{:03}", day_of_year(y, m, d)),
            Piece::Hour => write!(out, "{hh:02}"),
            Piece::Minute => write!(out, "{mm:02}"),
            Piece::Second => write!(out, "{ss:02}"),
            Piece::SecondFrac(n) => write!(out, "{ss:02}.{}", frac(*n)),
            Piece::Frac(n) => write!(out, "{}", frac(*n)),
            Piece::Epoch => write!(out, "{secs}"),
            Piece::Offset => write!(out, "+0000"),
            Piece::Zone => write!(out, "UTC"),
        };
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envoys_default_and_strftime_formats() {
        // 2026-12-07T21:08:30.123456789Z
        let t = UNIX_EPOCH + Duration::new(1_796_677_710, 123_456_789);
        assert_eq!(format(t, None), "2026-12-07T21:08:30.123Z");
        let f = |s: &str| format(t, Some(&TimeFormat::parse(s).unwrap()));
        assert_eq!(f("%Y-%m-%dT%H:%M:%E6SZ"), "2026-12-07T21:08:30.123456Z");
        assert_eq!(f("%s.%3f"), "1796677710.123");
        assert_eq!(
            f("%F %T %z %Z %j %y %%"),
            "2026-12-07 21:08:30 +0000 UTC 341 26 %"
        );
        assert_eq!(f("%f"), "123456789");
        assert_eq!(format(UNIX_EPOCH, None), "1970-01-01T00:00:00.000Z");
        // A leap day.
        let leap = UNIX_EPOCH + Duration::from_secs(951_782_400); // 2000-02-29
        assert_eq!(
            format(leap, Some(&TimeFormat::parse("%F %j").unwrap())),
            "2000-02-29 060"
        );
    }

    #[test]
    fn unknown_specifiers_are_refused() {
        for f in ["%Q", "%E0S", "%", "%0f", "%Ez"] {
            assert!(TimeFormat::parse(f).is_err(), "{f}");
        }
    }
}
