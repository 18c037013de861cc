//! HBONE: TCP tunnelled as HTTP/2 CONNECT streams inside mTLS, port 15008.

pub mod client;
pub mod error;
pub mod guard;
pub mod pool;
pub mod request;
pub mod server;
pub mod stream;
pub mod tuning;

pub use error::HboneError;
pub use pool::{Pool, PoolKey, StreamGuard};
pub use request::{connect_authority, connect_target, protocol_abuse, respond_status, BadConnect, HboneAddress};
pub use stream::H2Stream;
pub use tuning::{
    h2_sizes, server_builder, set_h2_sizes, tune_tls, H2Sizes, CONNECTION_WINDOW, MAX_FRAME, MAX_HEADER_BYTES, PING_INTERVAL, PING_TIMEOUT, SERVER_MAX_STREAMS,
    STREAM_WINDOW, TLS_SEND_BUFFER_LIMIT,
};

/// W3C traceparent with fresh ids for one tunnelled connection.
pub fn traceparent() -> String {
    let trace: u128 = rand::random();
    let span: u64 = rand::random();
    format!("00-{trace:032x}-{span:016x}-01")
}
