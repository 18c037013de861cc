//! waypoint: the per-namespace / per-service-account L7 proxy. It terminates HBONE
//! (mTLS with its own SPIFFE identity, HTTP/2 CONNECT), tells HTTP/1.1, HTTP/2 and gRPC
//! from other traffic inside each tunnel, applies AuthorizationPolicy and HTTPRoute
//! rules to HTTP requests, and forwards over pooled HBONE to the chosen endpoint's
//! node; anything else is relayed at L4. The mesh code it shares with the node proxy
//! (identity, HBONE, mesh state, L4 policy) is ztunnel's library; L7 is here.

// Errors are returned when config is loaded, never per request, and name the file and
// field: their size costs nothing there.
#![allow(clippy::result_large_err)]

pub mod authn;
pub mod authz;
pub mod config;
pub mod context;
pub mod destination;
pub mod detect;
pub mod dump;
pub mod egress;
pub mod extauthz;
#[doc(hidden)]
pub mod fuzzing;
pub mod grant;
pub mod http;
pub mod idle;
pub mod k8s;
pub mod labels;
pub mod lb;
pub mod lookup;
pub mod network;
pub mod object;
pub mod path;
pub mod proxy_config;
pub mod route;
pub mod server;
pub mod telemetry;
pub mod trace;
pub mod tunnel;
pub mod upstream;
