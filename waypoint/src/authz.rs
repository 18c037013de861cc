//! Istio `AuthorizationPolicy` with `targetRefs`, enforced by the waypoint per request.
//!
//! Semantics (Istio): a policy matches if any rule matches; a rule matches when its
//! `from` (any source), `to` (any operation) and every `when` condition hold; inside a
//! source or operation every non-empty field must hold, a field holds if any value
//! matches and a `not*` field holds if none does. Any matching DENY denies; otherwise,
//! when ALLOW policies exist one must match; AUDIT policies only get reported.
//!
//! Values are Istio string matches (exact, `prefix*`, `*suffix`, `*` = non-empty),
//! compared as strings and never turned into regular expressions.
//!
//! Where the request leaves room for doubt (an attribute missing, a header sent several
//! times) matching fails closed through a polarity: for ALLOW the doubt counts against
//! the match, for DENY and AUDIT it counts for it. So an anonymous peer satisfies no
//! ALLOW field about identities (not even `notPrincipals`), and a repeated header must
//! match with every value to satisfy an ALLOW but with one value to trigger a DENY:
//! appending a value can neither sneak past an ALLOW nor dodge a DENY.

mod eval;
mod model;
pub mod trust_domain;
mod validate;

#[cfg(test)]
mod tests;

pub use eval::{custom_matches, evaluate, Request, Verdict};
pub use model::{
    Action, AuthorizationPolicy, Condition, From, Operation, ProviderRef, Rule, Source, To,
};
