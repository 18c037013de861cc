//! How one field of a policy rule holds, shared by L4 authorization (`rbac`) and the
//! waypoint's L7 AuthorizationPolicy: a list of values to match (`principals`, ...) or
//! not to match (`notPrincipals`, ...) against one attribute of the connection or request.
//! When the attribute is missing (an anonymous peer has no principal) the caller decides
//! through `if_missing`: L4 fails positive fields and passes negative ones (Envoy RBAC);
//! L7 fails closed by the policy's action.

/// Empty list: no constraint. A missing value gives `if_missing`; a present one must
/// match one entry.
pub fn positive<M, V: Copy>(
    list: &[M],
    value: Option<V>,
    if_missing: bool,
    f: impl Fn(&M, V) -> bool,
) -> bool {
    list.is_empty() || value.map_or(if_missing, |v| list.iter().any(|m| f(m, v)))
}

/// Empty list: no constraint. A missing value gives `if_missing`; a present one must
/// match no entry.
pub fn negative<M, V: Copy>(
    list: &[M],
    value: Option<V>,
    if_missing: bool,
    f: impl Fn(&M, V) -> bool,
) -> bool {
    list.is_empty() || value.map_or(if_missing, |v| !list.iter().any(|m| f(m, v)))
}
