//! Gateway API durations (GEP-2257), as route timeouts and retry backoffs are written.

use std::time::Duration;

use serde::Deserialize;

/// A Gateway API duration (GEP-2257: up to four `<number><h|m|s|ms>` parts, e.g. `1h30m`,
/// `500ms`); `0s` turns the timeout off.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GatewayDuration(pub Duration);

impl std::str::FromStr for GatewayDuration {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || {
            format!(
                "{s:?} is not a duration like \"10s\", \"500ms\" or \"1h30m\" (units h, m, s, ms)"
            )
        };
        let mut total = Duration::ZERO;
        let mut rest = s;
        let mut parts = 0;
        while !rest.is_empty() {
            let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
            if digits == 0 || digits > 5 {
                return Err(bad());
            }
            let n: u64 = rest[..digits].parse().map_err(|_| bad())?;
            rest = &rest[digits..];
            let (unit, len) = if rest.starts_with("ms") {
                (Duration::from_millis(1), 2)
            } else {
                match rest.bytes().next() {
                    Some(b'h') => (Duration::from_secs(3600), 1),
                    Some(b'm') => (Duration::from_secs(60), 1),
                    Some(b's') => (Duration::from_secs(1), 1),
                    _ => return Err(bad()),
                }
            };
            rest = &rest[len..];
            total += unit * u32::try_from(n).map_err(|_| bad())?;
            parts += 1;
        }
        if parts == 0 || parts > 4 {
            return Err(bad());
        }
        Ok(GatewayDuration(total))
    }
}

impl<'de> Deserialize<'de> for GatewayDuration {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

impl GatewayDuration {
    /// As a timeout: `0s` turns it off.
    pub fn as_timeout(self) -> Option<Duration> {
        Some(self.0).filter(|d| !d.is_zero())
    }
}
