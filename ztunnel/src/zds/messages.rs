//! ZDS's messages, field numbers from istio-cni's zds.proto.

#[derive(Clone, Copy, Debug, PartialEq, Eq, prost::Enumeration)]
#[repr(i32)]
pub enum Version {
    NotUsed = 0,
    V1 = 1,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ZdsHello {
    #[prost(enumeration = "Version", tag = "1")]
    pub version: i32,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct WorkloadInfo {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub namespace: String,
    #[prost(string, tag = "3")]
    pub service_account: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct AddWorkload {
    #[prost(string, tag = "1")]
    pub uid: String,
    #[prost(message, optional, tag = "2")]
    pub workload_info: Option<WorkloadInfo>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct KeepWorkload {
    #[prost(string, tag = "1")]
    pub uid: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct DelWorkload {
    #[prost(string, tag = "2")]
    pub uid: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct SnapshotSent {}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Payload {
    #[prost(message, tag = "1")]
    Add(AddWorkload),
    #[prost(message, tag = "2")]
    Del(DelWorkload),
    #[prost(message, tag = "3")]
    SnapshotSent(SnapshotSent),
    #[prost(message, tag = "5")]
    Keep(KeepWorkload),
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct WorkloadRequest {
    #[prost(oneof = "Payload", tags = "1, 2, 3, 5")]
    pub payload: Option<Payload>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Ack {
    #[prost(string, tag = "1")]
    pub error: String,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum ResponsePayload {
    #[prost(message, tag = "1")]
    Ack(Ack),
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct WorkloadResponse {
    #[prost(oneof = "ResponsePayload", tags = "1")]
    pub payload: Option<ResponsePayload>,
}

impl WorkloadResponse {
    pub fn ack(error: Option<String>) -> Self {
        WorkloadResponse {
            payload: Some(ResponsePayload::Ack(Ack {
                error: error.unwrap_or_default(),
            })),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    #[test]
    fn field_numbers_match_istio() {
        // add(1){uid(1)="u", workload_info(2){name(1)="n"}}
        let req = WorkloadRequest {
            payload: Some(Payload::Add(AddWorkload {
                uid: "u".into(),
                workload_info: Some(WorkloadInfo {
                    name: "n".into(),
                    ..Default::default()
                }),
            })),
        };
        assert_eq!(
            req.encode_to_vec(),
            vec![0x0a, 0x08, 0x0a, 0x01, b'u', 0x12, 0x03, 0x0a, 0x01, b'n']
        );
        // del(2){uid(2)="u"}
        let del = WorkloadRequest {
            payload: Some(Payload::Del(DelWorkload { uid: "u".into() })),
        };
        assert_eq!(del.encode_to_vec(), vec![0x12, 0x03, 0x12, 0x01, b'u']);
        // keep(5){uid(1)}, snapshot_sent(3){}
        let keep = WorkloadRequest {
            payload: Some(Payload::Keep(KeepWorkload { uid: "u".into() })),
        };
        assert_eq!(keep.encode_to_vec(), vec![0x2a, 0x03, 0x0a, 0x01, b'u']);
        let snap = WorkloadRequest {
            payload: Some(Payload::SnapshotSent(SnapshotSent {})),
        };
        assert_eq!(snap.encode_to_vec(), vec![0x1a, 0x00]);
        assert_eq!(
            ZdsHello {
                version: Version::V1 as i32
            }
            .encode_to_vec(),
            vec![0x08, 0x01]
        );
        assert_eq!(
            WorkloadResponse::ack(Some("e".into())).encode_to_vec(),
            vec![0x0a, 0x03, 0x0a, 0x01, b'e']
        );
    }
}
