//! Gateway API `HTTPRoute` (and `GRPCRoute`, as the HTTPRoute it amounts to: `grpc`), as a waypoint applies it (GAMMA: routes attach to a Service
//! by `parentRefs`, or to the waypoint's own Gateway).
//!
//! Which rule serves a request follows the Gateway API's precedence over every match of
//! every route attached to the request's target: an `Exact` path, then a regular
//! expression, then the longest `PathPrefix`; then a method match; then the most header
//! matches; then the most query parameter matches; ties go to the route listed first in
//! the config, then the rule and match listed first. Routes attached to the Service win
//! over routes attached to the Gateway. When routes are attached but none matches, the
//! waypoint answers 404 (as Gateway API requires).
//!
//! Connections the waypoint relays at L4 follow `l4`: a VirtualService's `tls` and `tcp`
//! rules, TLSRoute and TCPRoute, chosen per service port as Istio's waypoint does.
//!
//! Everything is parsed and compiled when the config loads (regexes, header names and
//! values, durations), so a request never meets a config error.

mod action;
mod cors;
pub mod delegate;
mod duration;
mod filter;
mod grpc;
mod l4;
mod model;
mod select;
mod tcp;
mod tls;
mod validate;
mod virtual_service;

#[cfg(test)]
mod tests;

pub use action::{Answer, Matched, UriRewrite};
pub use cors::{Cors, CorsOutcome};
pub use duration::GatewayDuration;
pub use grpc::GrpcRoute;
pub use l4::{select_l4, L4Match, L4Route, L4Rule, L4Selected, SniHosts};
pub use model::{
    BackendRef, Fault, Filter, Fraction, HeaderMatch, HeaderModifier, HttpHeader, HttpRoute,
    MethodMatch, PathMatch, PathModifier, QueryParamMatch, RequestMirror, RequestRedirect, Retry,
    RouteKind, RouteMatch, RouteRule, SessionKind, SessionPersistence, Timeouts, UrlRewrite,
    ValueMatch,
};
pub use select::{select, RouteRequest, Selected, Selection};
pub use tcp::TcpRoute;
pub use tls::TlsRoute;
pub use virtual_service::{
    host_service, mesh_default as mesh_default_retry, MeshRetry, VirtualService, VsRoutes,
};
