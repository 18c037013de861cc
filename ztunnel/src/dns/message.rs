//! DNS messages from pods and the responses to them (hickory-proto does the encoding).
//! Nothing a pod sends can make this panic or allocate without bound: the header is read
//! by hand first, so a message claiming 65535 questions is refused before hickory would
//! reserve room for them, and anything malformed gets FORMERR (or nothing, when not
//! even a header arrived, or when it is itself a response: answering those could loop).

use hickory_proto::op::{Edns, Message, ResponseCode};
use hickory_proto::rr::rdata::{A, AAAA, CNAME};
use hickory_proto::rr::{Name, RData, Record};

use super::resolver::{MeshAnswer, MESH_TTL};

/// The EDNS UDP payload size we advertise, to pods and upstream (the DNS flag day 2020 value).
pub const EDNS_PAYLOAD: u16 = 1232;

/// The fixed 12-byte header, read without trusting the rest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub id: u16,
    pub response: bool,
    pub opcode: u8,
    pub recursion_desired: bool,
    pub qdcount: u16,
}

impl Header {
    pub fn parse(wire: &[u8]) -> Option<Header> {
        let h: &[u8; 12] = wire.get(..12)?.try_into().ok()?;
        Some(Header {
            id: u16::from_be_bytes([h[0], h[1]]),
            response: h[2] & 0x80 != 0,
            opcode: (h[2] >> 3) & 0x0f,
            recursion_desired: h[2] & 0x01 != 0,
            qdcount: u16::from_be_bytes([h[4], h[5]]),
        })
    }

    /// A bare response (no sections) with `rcode` (< 16).
    fn error(&self, rcode: ResponseCode) -> Vec<u8> {
        let mut out = vec![0u8; 12];
        out[..2].copy_from_slice(&self.id.to_be_bytes());
        out[2] = 0x80 | (self.opcode << 3) | u8::from(self.recursion_desired);
        out[3] = 0x80 | (rcode.low() & 0x0f);
        out
    }
}

/// What to do with a message from a pod.
#[derive(Debug)]
pub enum Incoming {
    /// A query with exactly one question, to be answered.
    Query(Box<Message>),
    /// Answer this at once (FORMERR, NOTIMP, BADVERS).
    Reject(Vec<u8>, &'static str),
    /// Not worth an answer.
    Drop(&'static str),
}

pub fn classify(wire: &[u8]) -> Incoming {
    let Some(h) = Header::parse(wire) else {
        return Incoming::Drop("shorter than a DNS header");
    };
    if h.response {
        return Incoming::Drop("a response, not a query");
    }
    if h.opcode != 0 {
        return Incoming::Reject(h.error(ResponseCode::NotImp), "opcode other than QUERY");
    }
    if h.qdcount != 1 {
        return Incoming::Reject(h.error(ResponseCode::FormErr), "not exactly one question");
    }
    let m = match Message::from_vec(wire) {
        Ok(m) => m,
        Err(_) => return Incoming::Reject(h.error(ResponseCode::FormErr), "malformed message"),
    };
    if m.edns.as_ref().is_some_and(|e| e.version() > 0) {
        // RFC 6891: an unknown EDNS version gets BADVERS, with our OPT record.
        let r = response_to(&m, ResponseCode::BADVERS);
        return Incoming::Reject(encode(&r, 512), "EDNS version above 0");
    }
    Incoming::Query(Box::new(m))
}

/// The EDNS record of our responses.
fn our_edns(dnssec_ok: bool) -> Edns {
    let mut e = Edns::new();
    e.set_max_payload(EDNS_PAYLOAD);
    e.set_dnssec_ok(dnssec_ok);
    e
}

pub fn dnssec_ok(req: &Message) -> bool {
    req.edns.as_ref().is_some_and(|e| e.flags().dnssec_ok)
}

/// An empty response to `req` with `code`: its question, its RD and CD bits, recursion
/// available, and an OPT record if it had one.
pub fn response_to(req: &Message, code: ResponseCode) -> Message {
    let mut m = Message::response(req.metadata.id, req.metadata.op_code);
    m.metadata.recursion_desired = req.metadata.recursion_desired;
    m.metadata.recursion_available = true;
    m.metadata.checking_disabled = req.metadata.checking_disabled;
    m.metadata.response_code = code;
    m.queries = req.queries.clone();
    m.edns = req.edns.as_ref().map(|_| our_edns(dnssec_ok(req)));
    m
}

/// The response to `req` from a mesh answer: authoritative, records with Istio's TTL.
pub fn mesh_response(req: &Message, answer: &MeshAnswer) -> Message {
    let mut m = response_to(req, ResponseCode::NoError);
    m.metadata.authoritative = true;
    // No address of the asked family: the name exists, with no records (no CNAME either).
    let Some(q) = req.queries.first().filter(|_| !answer.addrs.is_empty()) else {
        return m;
    };
    let asked = q.name().clone();
    let canonical = answer
        .canonical
        .as_ref()
        .and_then(|c| Name::from_ascii(format!("{c}.")).ok());
    let owner = match canonical {
        Some(target) => {
            m.answers.push(Record::from_rdata(
                asked,
                MESH_TTL,
                RData::CNAME(CNAME(target.clone())),
            ));
            target
        }
        None => asked,
    };
    for ip in &answer.addrs {
        let rdata = match ip {
            std::net::IpAddr::V4(v4) => RData::A(A(*v4)),
            std::net::IpAddr::V6(v6) => RData::AAAA(AAAA(*v6)),
        };
        m.answers
            .push(Record::from_rdata(owner.clone(), MESH_TTL, rdata));
    }
    m
}

/// The response to `req` from an upstream answer (or a cached one): the upstream's
/// sections and flags, with the client's id, question (its letter case) and RD bit, and
/// our OPT record only if the client sent one.
pub fn forwarded_response(req: &Message, mut up: Message) -> Message {
    up.metadata.id = req.metadata.id;
    up.metadata.recursion_desired = req.metadata.recursion_desired;
    up.queries = req.queries.clone();
    up.signature = None;
    up.edns = req.edns.as_ref().map(|_| our_edns(dnssec_ok(req)));
    if up.edns.is_none() && up.metadata.response_code.high() != 0 {
        // An extended code cannot be said without EDNS.
        up.metadata.response_code = ResponseCode::ServFail;
    }
    up
}

/// How large a UDP response to `req` may be: 512 bytes, or what its EDNS record says
/// (at most 4096).
pub fn udp_limit(req: &Message) -> usize {
    req.edns
        .as_ref()
        .map_or(512, |e| usize::from(e.max_payload()).clamp(512, 4096))
}

/// `m` on the wire, at most `limit` bytes: when larger, the header, question and OPT
/// record with TC set (the client asks again over TCP).
pub fn encode(m: &Message, limit: usize) -> Vec<u8> {
    match m.to_vec() {
        Ok(v) if v.len() <= limit => return v,
        Ok(_) => {}
        Err(e) => {
            tracing::warn!(error = %e, "cannot encode a DNS response; answering SERVFAIL");
            let mut fail =
                Message::error_msg(m.metadata.id, m.metadata.op_code, ResponseCode::ServFail);
            fail.queries = m.queries.clone();
            return fail.to_vec().unwrap_or_default();
        }
    }
    // Keeps the header (TC set), the question and the OPT record.
    m.truncate().to_vec().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use hickory_proto::op::{MessageType, OpCode, Query};
    use hickory_proto::rr::RecordType;

    fn query(name: &str, t: RecordType) -> Message {
        let mut m = Message::new(0x1234, MessageType::Query, OpCode::Query);
        m.metadata.recursion_desired = true;
        m.queries
            .push(Query::query(Name::from_ascii(name).unwrap(), t));
        m
    }

    fn mesh_answer(addrs: Vec<std::net::IpAddr>) -> MeshAnswer {
        MeshAnswer {
            service: crate::state::NamespacedHostname(
                "default/echo.default.svc.cluster.local".into(),
            ),
            canonical: None,
            addrs,
        }
    }

    fn reject_code(wire: &[u8]) -> u8 {
        match classify(wire) {
            Incoming::Reject(r, _) => {
                assert_eq!(&r[..2], &wire[..2], "the id is echoed");
                assert!(r[2] & 0x80 != 0, "QR set");
                r[3] & 0x0f
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn malformed_input_never_panics() {
        let good = query("echo.default.", RecordType::A).to_vec().unwrap();
        assert!(matches!(classify(&good), Incoming::Query(_)));
        // Every prefix and every single-byte corruption of a valid query.
        for n in 0..good.len() {
            let _ = classify(&good[..n]);
            for b in [0x00, 0x3f, 0x40, 0xc0, 0xff] {
                let mut bad = good.clone();
                bad[n] = b;
                let _ = classify(&bad);
            }
        }
        assert!(matches!(classify(&good[..11]), Incoming::Drop(_)));
        assert_eq!(
            reject_code(&good[..good.len() - 1]),
            1,
            "truncated question: FORMERR"
        );
        // A compression pointer loop in the name.
        let mut looped = good[..12].to_vec();
        looped.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1]);
        assert_eq!(reject_code(&looped), 1);
        // Random garbage with a plausible header.
        let mut x: u32 = 0x9e3779b9;
        for _ in 0..2000 {
            let len = (x % 300) as usize + 12;
            let mut v = Vec::with_capacity(len);
            for _ in 0..len {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                v.push(x as u8);
            }
            v[2] &= 0x7f;
            let _ = classify(&v);
        }
    }

    #[test]
    fn counts_opcodes_responses_and_edns_versions() {
        let mut m = query("a.", RecordType::A);
        m.queries
            .push(Query::query(Name::from_ascii("b.").unwrap(), RecordType::A));
        assert_eq!(
            reject_code(&m.to_vec().unwrap()),
            1,
            "two questions: FORMERR"
        );
        // 65535 questions claimed in a 12-byte message: refused before parsing.
        let mut claim = query("a.", RecordType::A).to_vec().unwrap()[..12].to_vec();
        claim[4] = 0xff;
        claim[5] = 0xff;
        assert_eq!(reject_code(&claim), 1);
        let mut notify = query("a.", RecordType::SOA);
        notify.metadata.op_code = OpCode::Notify;
        assert_eq!(reject_code(&notify.to_vec().unwrap()), 4, "NOTIMP");
        let mut resp = query("a.", RecordType::A);
        resp.metadata.message_type = MessageType::Response;
        assert!(matches!(
            classify(&resp.to_vec().unwrap()),
            Incoming::Drop(_)
        ));
        let mut v1 = query("a.", RecordType::A);
        let mut e = Edns::new();
        e.set_version(1);
        v1.edns = Some(e);
        let Incoming::Reject(r, _) = classify(&v1.to_vec().unwrap()) else {
            panic!()
        };
        let r = Message::from_vec(&r).unwrap();
        // BADVERS and BADSIG share code 16.
        assert_eq!(
            (
                r.metadata.response_code.high(),
                r.metadata.response_code.low()
            ),
            (1, 0)
        );
        assert_eq!(r.edns.unwrap().version(), 0);
    }

    #[test]
    fn mesh_answers_with_and_without_cname() {
        let req = query("Echo.default.svc.cluster.local.", RecordType::A);
        let ans = mesh_answer(vec!["10.96.0.10".parse().unwrap()]);
        let r = Message::from_vec(&encode(&mesh_response(&req, &ans), 512)).unwrap();
        assert!(
            r.metadata.authoritative
                && r.metadata.recursion_available
                && r.metadata.recursion_desired
        );
        assert_eq!(r.metadata.id, 0x1234);
        assert_eq!(
            r.queries[0].name().to_ascii(),
            "Echo.default.svc.cluster.local.",
            "the question's case is kept"
        );
        assert_eq!(r.answers.len(), 1);
        assert_eq!(r.answers[0].ttl, 30);
        assert_eq!(r.answers[0].data, RData::A(A::new(10, 96, 0, 10)));
        let via = MeshAnswer {
            canonical: Some("echo.default".into()),
            ..ans
        };
        let req = query("echo.default.default.svc.cluster.local.", RecordType::A);
        let r = Message::from_vec(&encode(&mesh_response(&req, &via), 512)).unwrap();
        assert_eq!(
            r.answers[0].data,
            RData::CNAME(CNAME(Name::from_ascii("echo.default.").unwrap()))
        );
        assert_eq!(r.answers[1].name.to_ascii(), "echo.default.");
        // No address of the family: NOERROR, empty.
        let none = MeshAnswer {
            addrs: vec![],
            ..via
        };
        let r = Message::from_vec(&encode(
            &mesh_response(&query("echo.", RecordType::AAAA), &none),
            512,
        ))
        .unwrap();
        assert_eq!(r.metadata.response_code, ResponseCode::NoError);
        assert!(r.answers.is_empty());
    }

    #[test]
    fn large_responses_are_truncated_to_the_limit() {
        let req = query("many.example.", RecordType::A);
        let ans = mesh_answer(
            (0..100u8)
                .map(|i| std::net::IpAddr::from([10, 0, 0, i]))
                .collect(),
        );
        let full = mesh_response(&req, &ans);
        let wire = encode(&full, udp_limit(&req));
        assert!(wire.len() <= 512);
        let r = Message::from_vec(&wire).unwrap();
        assert!(r.metadata.truncation && r.answers.is_empty());
        assert_eq!(r.metadata.id, 0x1234);
        assert_eq!(r.queries.len(), 1);
        let tcp = Message::from_vec(&encode(&full, 65535)).unwrap();
        assert_eq!(tcp.answers.len(), 100);
        // EDNS raises the limit.
        let mut big = query("many.example.", RecordType::A);
        let mut e = Edns::new();
        e.set_max_payload(4096);
        big.edns = Some(e);
        assert_eq!(udp_limit(&big), 4096);
        assert!(
            !Message::from_vec(&encode(&mesh_response(&big, &ans), udp_limit(&big)))
                .unwrap()
                .metadata
                .truncation
        );
    }

    #[test]
    fn forwarded_responses_take_the_clients_id_and_question() {
        let req = query("WWW.example.com.", RecordType::A);
        let mut up = Message::new(999, MessageType::Response, OpCode::Query);
        up.queries.push(Query::query(
            Name::from_ascii("www.example.com.").unwrap(),
            RecordType::A,
        ));
        up.metadata.response_code = ResponseCode::NXDomain;
        up.edns = Some(Edns::new());
        let r = forwarded_response(&req, up.clone());
        assert_eq!(r.metadata.id, 0x1234);
        assert_eq!(r.queries[0].name().to_ascii(), "WWW.example.com.");
        assert_eq!(r.metadata.response_code, ResponseCode::NXDomain);
        assert!(r.edns.is_none(), "no OPT for a client that sent none");
        up.metadata.response_code = ResponseCode::BADCOOKIE;
        assert_eq!(
            forwarded_response(&req, up).metadata.response_code,
            ResponseCode::ServFail
        );
    }
}
