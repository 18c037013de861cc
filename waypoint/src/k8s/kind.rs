//! The kinds the waypoint watches in a cluster: their API resources, the versions tried
//! when a CRD serves several, and their names in logs and the dump.

use kube::api::ApiResource;

use crate::object::GATEWAY_GROUP;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(super) enum Kind {
    Gateway,
    HttpRoute,
    GrpcRoute,
    TcpRoute,
    TlsRoute,
    ReferenceGrant,
    DestinationRule,
    VirtualService,
    AuthorizationPolicy,
    RequestAuthentication,
    Telemetry,
    Service,
    Namespace,
    /// The mesh config's ConfigMap. Not waited for: without it (not there, or not
    /// readable) CUSTOM policies deny what they match and everything else applies.
    MeshConfig,
}

pub(super) const KINDS: [Kind; 14] = [
    Kind::DestinationRule,
    Kind::VirtualService,
    Kind::Gateway,
    Kind::HttpRoute,
    Kind::GrpcRoute,
    Kind::TcpRoute,
    Kind::TlsRoute,
    Kind::ReferenceGrant,
    Kind::AuthorizationPolicy,
    Kind::RequestAuthentication,
    Kind::Telemetry,
    Kind::Service,
    Kind::Namespace,
    Kind::MeshConfig,
];

pub(super) fn resource(kind: Kind) -> ApiResource {
    let (group, version, k, plural) = match kind {
        Kind::Gateway => (GATEWAY_GROUP, "v1", "Gateway", "gateways"),
        Kind::HttpRoute => (GATEWAY_GROUP, "v1", "HTTPRoute", "httproutes"),
        Kind::GrpcRoute => (GATEWAY_GROUP, "v1", "GRPCRoute", "grpcroutes"),
        // `v1` since Gateway API v1.6.0 (standard channel); `v1alpha2` before (see
        // `versions`: the one served is watched).
        Kind::TcpRoute => (GATEWAY_GROUP, "v1", "TCPRoute", "tcproutes"),
        // `v1` since Gateway API v1.5.0 (standard channel, and the only version it serves
        // in v1.6.0); the experimental channel serves `v1alpha3` and `v1alpha2` too.
        Kind::TlsRoute => (GATEWAY_GROUP, "v1", "TLSRoute", "tlsroutes"),
        Kind::ReferenceGrant => (
            GATEWAY_GROUP,
            "v1beta1",
            "ReferenceGrant",
            "referencegrants",
        ),
        Kind::DestinationRule => (
            "networking.istio.io",
            "v1",
            "DestinationRule",
            "destinationrules",
        ),
        Kind::VirtualService => (
            "networking.istio.io",
            "v1",
            "VirtualService",
            "virtualservices",
        ),
        Kind::AuthorizationPolicy => (
            "security.istio.io",
            "v1",
            "AuthorizationPolicy",
            "authorizationpolicies",
        ),
        Kind::RequestAuthentication => (
            "security.istio.io",
            "v1",
            "RequestAuthentication",
            "requestauthentications",
        ),
        Kind::Telemetry => ("telemetry.istio.io", "v1", "Telemetry", "telemetries"),
        Kind::Service => ("", "v1", "Service", "services"),
        Kind::Namespace => ("", "v1", "Namespace", "namespaces"),
        Kind::MeshConfig => ("", "v1", "ConfigMap", "configmaps"),
    };
    ApiResource {
        group: group.into(),
        version: version.into(),
        api_version: if group.is_empty() {
            version.into()
        } else {
            format!("{group}/{version}")
        },
        kind: k.into(),
        plural: plural.into(),
    }
}

/// The versions of `kind` the waypoint can read, in the order it prefers them: the first
/// one the API server serves is watched (as Istio does, which reads TCPRoute and TLSRoute
/// at `v1`; Gateway API v1.6.0's standard channel serves only `v1` of both, its
/// experimental channel `v1alpha2` too, and `v1alpha3` of TLSRoute).
pub(super) fn versions(kind: Kind) -> &'static [&'static str] {
    match kind {
        Kind::TcpRoute => &["v1", "v1alpha2"],
        Kind::TlsRoute => &["v1", "v1alpha3", "v1alpha2"],
        Kind::ReferenceGrant => &["v1beta1", "v1"],
        _ => &[],
    }
}

pub(super) fn route_kind_name(kind: Kind) -> &'static str {
    match kind {
        Kind::VirtualService => "VirtualService",
        Kind::GrpcRoute => "GRPCRoute",
        Kind::TcpRoute => "TCPRoute",
        Kind::TlsRoute => "TLSRoute",
        _ => "HTTPRoute",
    }
}
