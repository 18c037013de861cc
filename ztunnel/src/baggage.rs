//! Istio's HBONE baggage: what one end of a tunnel says about its workload, as a W3C
//! `baggage` header of OpenTelemetry keys. The client side sends its own on each CONNECT
//! (request baggage); the server side answers a 200 with the destination pod's
//! (response baggage, `ENABLE_RESPONSE_BAGGAGE`, on by default). Istio's ztunnel uses
//! the request's to label a source it cannot look up (one behind an east-west gateway),
//! and the response's to label the destination behind a gateway (double HBONE), which the
//! client's proxy does not know by address. The format and the parsing are Istio's
//! (`src/baggage.rs`); the parsing is bounded here, as the header comes from the peer.

use http::header::{GetAll, HeaderValue};

/// The header's name.
pub const HEADER: &str = "baggage";

/// Baggage headers of a request or response together may be this long; longer is
/// ignored as a whole, like a malformed one (the W3C baggage limit: 8192 bytes).
pub const MAX_BYTES: usize = 8192;

/// A known key's value may be this long (a Kubernetes name is at most 253); a longer one
/// makes the whole baggage ignored, so what a peer says cannot grow a metric label without bound.
pub const MAX_VALUE_BYTES: usize = 253;

/// The workload one end of a tunnel describes (each field: absent or non-empty).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Baggage {
    /// `k8s.cluster.name`
    pub cluster_id: Option<String>,
    /// `k8s.namespace.name`
    pub namespace: Option<String>,
    /// `k8s.<workload type>.name`
    pub workload_name: Option<String>,
    /// `service.name`: the canonical service.
    pub service_name: Option<String>,
    /// `service.version`: the canonical revision.
    pub revision: Option<String>,
    /// `cloud.region`
    pub region: Option<String>,
    /// `cloud.availability_zone`
    pub zone: Option<String>,
}

/// Why a peer's baggage is ignored (Istio ignores baggage that is not visible ASCII; the
/// bounds are ours).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BaggageError {
    #[error("baggage is not visible ASCII")]
    NotAscii,
    #[error("baggage of {0} bytes, over the {MAX_BYTES}-byte limit")]
    TooLong(usize),
    #[error("baggage value of {0} bytes, over the {MAX_VALUE_BYTES}-byte limit")]
    ValueTooLong(usize),
}

impl Baggage {
    /// The header value, as Istio's `baggage_header_val`: the known fields in Istio's
    /// order, `k8s.<workload_type>.name` for the workload (`deployment`, `cronjob`, `pod`,
    /// `job`), joined by `,`, values as they are (no encoding).
    pub fn header_value(&self, workload_type: &str) -> String {
        let workload_key = format!("k8s.{workload_type}.name");
        [
            ("k8s.cluster.name", &self.cluster_id),
            ("k8s.namespace.name", &self.namespace),
            (workload_key.as_str(), &self.workload_name),
            ("service.name", &self.service_name),
            ("service.version", &self.revision),
            ("cloud.region", &self.region),
            ("cloud.availability_zone", &self.zone),
        ]
        .iter()
        .filter_map(|(k, v)| v.as_ref().map(|v| format!("{k}={v}")))
        .collect::<Vec<_>>()
        .join(",")
    }

    /// Parses every `baggage` header of a request or response, as Istio's
    /// `parse_baggage_header`: each header is split at `,` into members and a member at
    /// `=`; the text between the first and any second `=` is the value, taken as it is
    /// (no trimming, no percent-decoding, properties after `;` kept), and an empty value
    /// clears the field. A later member wins over an earlier one of the same key; unknown
    /// keys and members without `=` are skipped. No header: all fields absent. A header
    /// that is not visible ASCII, or (ours) headers over [`MAX_BYTES`] or a value over
    /// [`MAX_VALUE_BYTES`], make it an error: the caller ignores the baggage, never the
    /// connection.
    pub fn parse(headers: GetAll<'_, HeaderValue>) -> Result<Baggage, BaggageError> {
        let total: usize = headers.iter().map(|h| h.len()).sum();
        if total > MAX_BYTES {
            return Err(BaggageError::TooLong(total));
        }
        let mut b = Baggage::default();
        for h in headers.iter() {
            let text = h.to_str().map_err(|_| BaggageError::NotAscii)?;
            for member in text.split(',') {
                let mut parts = member.split('=');
                let (Some(key), Some(value)) = (parts.next(), parts.next()) else {
                    continue;
                };
                let field = match key {
                    "k8s.cluster.name" => &mut b.cluster_id,
                    "k8s.namespace.name" => &mut b.namespace,
                    "k8s.deployment.name"
                    | "k8s.cronjob.name"
                    | "k8s.pod.name"
                    | "k8s.job.name" => &mut b.workload_name,
                    "service.name" => &mut b.service_name,
                    "service.version" => &mut b.revision,
                    "cloud.region" => &mut b.region,
                    "cloud.availability_zone" => &mut b.zone,
                    _ => continue,
                };
                if value.len() > MAX_VALUE_BYTES {
                    return Err(BaggageError::ValueTooLong(value.len()));
                }
                *field = Some(value.to_string()).filter(|v| !v.is_empty());
            }
        }
        Ok(b)
    }

    /// Parses the `baggage` headers of `headers` (see [`Baggage::parse`]).
    pub fn of(headers: &http::HeaderMap) -> Result<Baggage, BaggageError> {
        Baggage::parse(headers.get_all(HEADER))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(values: &[&[u8]]) -> Result<Baggage, BaggageError> {
        let mut h = http::HeaderMap::new();
        for v in values {
            h.append(HEADER, HeaderValue::from_bytes(v).expect("a header value"));
        }
        Baggage::of(&h)
    }

    fn full() -> Baggage {
        Baggage {
            cluster_id: Some("K1".into()),
            namespace: Some("NS1".into()),
            workload_name: Some("N1".into()),
            service_name: Some("N2".into()),
            revision: Some("V1".into()),
            region: Some("r1".into()),
            zone: Some("z1".into()),
        }
    }

    #[test]
    fn the_header_is_istios() {
        // Istio's baggage_header_val for the same workload, byte for byte.
        assert_eq!(
            full().header_value("deployment"),
            "k8s.cluster.name=K1,k8s.namespace.name=NS1,k8s.deployment.name=N1,service.name=N2,service.version=V1,cloud.region=r1,cloud.availability_zone=z1"
        );
        let some = Baggage {
            namespace: Some("NS1".into()),
            workload_name: Some("N1".into()),
            ..Default::default()
        };
        assert_eq!(
            some.header_value("cronjob"),
            "k8s.namespace.name=NS1,k8s.cronjob.name=N1"
        );
        assert_eq!(Baggage::default().header_value("deployment"), "");
        for kind in ["deployment", "cronjob", "pod", "job"] {
            assert_eq!(parse(&[full().header_value(kind).as_bytes()]), Ok(full()));
        }
    }

    #[test]
    fn parses_as_istio_does() {
        // Istio's own cases: one header, empty values, several headers, none.
        assert_eq!(
            parse(&[b"k8s.cluster.name=K1,k8s.namespace.name=NS1,k8s.deployment.name=N1,service.name=N2,service.version=V1"]),
            Ok(Baggage { region: None, zone: None, ..full() })
        );
        assert_eq!(
            parse(&[b"k8s.cluster.name=,k8s.namespace.name=,k8s.deployment.name=,service.name=,service.version="]),
            Ok(Baggage::default())
        );
        assert_eq!(
            parse(&[
                b"k8s.cluster.name=K1",
                b"k8s.namespace.name=NS1",
                b"k8s.deployment.name=N1",
                b"service.name=N2",
                b"service.version=V1",
                b"cloud.region=r1,cloud.availability_zone=z1",
            ]),
            Ok(full())
        );
        assert_eq!(parse(&[]), Ok(Baggage::default()));
        // The other workload kinds Istio reads; a kind it does not (daemonset) is skipped.
        for k in ["k8s.cronjob.name", "k8s.pod.name", "k8s.job.name"] {
            assert_eq!(
                parse(&[format!("{k}=w").as_bytes()])
                    .unwrap()
                    .workload_name
                    .as_deref(),
                Some("w")
            );
        }
        assert_eq!(parse(&[b"k8s.daemonset.name=w"]), Ok(Baggage::default()));
    }

    #[test]
    fn duplicate_keys_the_last_wins_and_an_empty_one_clears() {
        assert_eq!(
            parse(&[b"k8s.namespace.name=a,k8s.namespace.name=b"])
                .unwrap()
                .namespace
                .as_deref(),
            Some("b")
        );
        assert_eq!(
            parse(&[b"k8s.namespace.name=a", b"k8s.namespace.name=c"])
                .unwrap()
                .namespace
                .as_deref(),
            Some("c")
        );
        assert_eq!(
            parse(&[b"k8s.namespace.name=a,k8s.namespace.name="])
                .unwrap()
                .namespace,
            None
        );
        // Two workload kinds: whichever comes last.
        assert_eq!(
            parse(&[b"k8s.deployment.name=d,k8s.pod.name=p"])
                .unwrap()
                .workload_name
                .as_deref(),
            Some("p")
        );
    }

    #[test]
    fn odd_members_are_taken_as_istio_takes_them() {
        let b = parse(&[
            b"garbage,,=,=x,k8s.namespace.name,service.name=a=b,service.version=v1;prop=1, k8s.cluster.name=c",
        ])
        .unwrap();
        // Between the first and second `=`; properties kept; a key with a leading space is
        // another key (Istio does not trim).
        assert_eq!(b.service_name.as_deref(), Some("a"));
        assert_eq!(b.revision.as_deref(), Some("v1;prop"));
        assert_eq!(b.namespace, None);
        assert_eq!(b.cluster_id, None);
        // Percent-encoding is not decoded.
        assert_eq!(
            parse(&[b"k8s.namespace.name=a%2Cb"])
                .unwrap()
                .namespace
                .as_deref(),
            Some("a%2Cb")
        );
    }

    #[test]
    fn hostile_baggage_is_refused_whole() {
        // Not visible ASCII (Istio's to_str error): the whole baggage is ignored.
        assert_eq!(
            parse(&[b"k8s.namespace.name=ok", b"k8s.cluster.name=\xff\xfe"]),
            Err(BaggageError::NotAscii)
        );
        assert_eq!(
            parse(&[b"k8s.namespace.name=caf\xc3\xa9"]),
            Err(BaggageError::NotAscii)
        );
        // Oversize: in total, over several headers, or one value.
        let long = format!("k8s.namespace.name={}", "a".repeat(MAX_BYTES));
        assert_eq!(
            parse(&[long.as_bytes()]),
            Err(BaggageError::TooLong(long.len()))
        );
        let half = format!("x={}", "a".repeat(MAX_BYTES / 2));
        assert!(matches!(
            parse(&[half.as_bytes(), half.as_bytes()]),
            Err(BaggageError::TooLong(_))
        ));
        let value = format!("k8s.namespace.name={}", "a".repeat(MAX_VALUE_BYTES + 1));
        assert_eq!(
            parse(&[value.as_bytes()]),
            Err(BaggageError::ValueTooLong(MAX_VALUE_BYTES + 1))
        );
        // An unknown key's long value harms nothing: skipped like the key.
        let other = format!("x={},k8s.namespace.name=n", "a".repeat(MAX_VALUE_BYTES + 1));
        assert_eq!(
            parse(&[other.as_bytes()]).unwrap().namespace.as_deref(),
            Some("n")
        );
        // At the limits: taken.
        let value = format!("k8s.namespace.name={}", "a".repeat(MAX_VALUE_BYTES));
        assert_eq!(
            parse(&[value.as_bytes()])
                .unwrap()
                .namespace
                .map(|n| n.len()),
            Some(MAX_VALUE_BYTES)
        );
        // Many members within the limit (unknown keys skipped): linear, no error.
        let many = "a=b,".repeat(MAX_BYTES / 4);
        assert_eq!(parse(&[many.as_bytes()]), Ok(Baggage::default()));
    }
}
