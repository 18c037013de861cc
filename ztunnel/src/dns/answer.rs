//! What a message from a pod gets, decided without I/O (so it is testable and
//! fuzzable): dropped, refused, answered from the mesh state, or forwarded upstream.

use hickory_proto::op::{Message, Query};
use hickory_proto::rr::{DNSClass, RecordType};

use super::message;
use super::resolver;

/// How a question arrived (the `request_protocol` label).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    Udp,
    Tcp,
}

impl Transport {
    pub(crate) fn label(self) -> &'static str {
        match self {
            Transport::Udp => "udp",
            Transport::Tcp => "tcp",
        }
    }
}

/// What a message from a pod gets.
#[derive(Debug)]
pub enum Local {
    /// Not worth an answer.
    Drop(&'static str),
    /// Refused at once (FORMERR, NOTIMP, BADVERS).
    Reject(Vec<u8>, &'static str),
    /// A mesh name, answered from the mesh state.
    Mesh { response: Vec<u8>, query: Query },
    /// Not ours: ask the upstream resolvers; the answer may be `limit` bytes.
    Forward {
        request: Box<Message>,
        query: Query,
        limit: usize,
    },
}

/// Classifies `wire` from `client` and answers it if it is a mesh name in `index`.
pub fn answer_locally(
    index: &resolver::MeshIndex,
    client: &crate::state::Workload,
    wire: &[u8],
    transport: Transport,
) -> Local {
    let req = match message::classify(wire) {
        message::Incoming::Query(m) => m,
        message::Incoming::Reject(resp, reason) => return Local::Reject(resp, reason),
        message::Incoming::Drop(reason) => return Local::Drop(reason),
    };
    let limit = match transport {
        Transport::Udp => message::udp_limit(&req),
        Transport::Tcp => usize::from(u16::MAX),
    };
    // classify() lets through only messages with exactly one question.
    let Some(q) = req.queries.first().cloned() else {
        return Local::Drop("no question");
    };
    let asked = q
        .name()
        .to_ascii()
        .trim_end_matches('.')
        .to_ascii_lowercase();
    let mesh = matches!(q.query_type(), RecordType::A | RecordType::AAAA)
        && q.query_class() == DNSClass::IN
        && !asked.is_empty();
    if let Some(answer) = mesh
        .then(|| index.lookup(&asked, client, q.query_type()))
        .flatten()
    {
        tracing::debug!(src.workload = %client.name, src.namespace = %client.namespace,
            query = %q.query_type(), domain = %asked, service = %answer.service, endpoints = answer.addrs.len(), result = "mesh", "dns request");
        return Local::Mesh {
            response: message::encode(&message::mesh_response(&req, &answer), limit),
            query: q,
        };
    }
    Local::Forward {
        request: req,
        query: q,
        limit,
    }
}
