//! What a VirtualService match has beyond an HTTPRoute match (Istio's
//! `TranslateRouteMatch` and `TranslateRoute`): `port`, `authority`, `scheme`,
//! `withoutHeaders`, `sourceNamespace`; `ignoreUriCase` is compiled into the path match.

use super::super::model::VsConditions;

/// What the conditions look at.
pub struct VsRequest<'a> {
    pub authority: &'a str,
    pub port: u16,
    pub headers: &'a http::HeaderMap,
    /// The waypoint's namespace.
    pub waypoint_namespace: &'a str,
}

impl VsConditions {
    pub fn matches(&self, req: &VsRequest) -> bool {
        !self.dropped
            && self.port.is_none_or(|p| p == req.port)
            && self
                .source_namespace
                .as_deref()
                .is_none_or(|ns| ns == req.waypoint_namespace)
            && self
                .authority
                .as_ref()
                .is_none_or(|m| m.matches(req.authority.as_bytes()))
            && self.scheme.as_ref().is_none_or(|m| m.matches(b"http"))
            && self.without_headers.iter().all(|(h, presence)| {
                let mut values = req.headers.get_all(&h.name).iter().peekable();
                match (values.peek().is_none(), presence) {
                    (true, true) => true,
                    (true, false) => !h.value.matches(b""),
                    (false, true) => false,
                    (false, false) => !values.any(|v| h.value.matches(v.as_bytes())),
                }
            })
    }
}
