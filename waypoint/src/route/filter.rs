//! What a rule's filters do to a request: header changes, redirects, rewrites, mirrors.

use http::header::HeaderMap;
use http::StatusCode;

use super::model::{HeaderModifier, PathModifier, RequestMirror, RequestRedirect, UrlRewrite};

impl HeaderModifier {
    /// Gateway API order: set, add, then remove (Envoy's for a VirtualService: remove
    /// first).
    pub fn apply(&self, h: &mut HeaderMap) {
        if self.remove_first {
            for r in &self.remove {
                h.remove(r.as_str());
            }
        }
        for s in &self.set {
            h.insert(s.name.clone(), s.value.clone());
        }
        for a in &self.add {
            h.append(a.name.clone(), a.value.clone());
        }
        if !self.remove_first {
            for r in &self.remove {
                h.remove(r.as_str());
            }
        }
    }
}

impl PathModifier {
    /// The new path. `matched_prefix` is the rule's matched `PathPrefix` (without its
    /// trailing slash); `path` is normalized and matched it.
    pub fn apply(&self, path: &str, matched_prefix: Option<&str>) -> String {
        match self {
            PathModifier::ReplaceFullPath(p) => p.clone(),
            PathModifier::ReplacePrefixMatch(replacement) => {
                let rest = matched_prefix
                    .and_then(|p| path.strip_prefix(p))
                    .unwrap_or(path);
                if rest.is_empty() {
                    return replacement.clone();
                }
                // `rest` starts with '/': join without doubling the slash.
                let joined = format!("{}{rest}", replacement.trim_end_matches('/'));
                if joined.is_empty() {
                    "/".into()
                } else {
                    joined
                }
            }
        }
    }
}

impl RequestRedirect {
    /// The status and `Location` for a request to `scheme://host[:port]path?query`.
    /// Port rules (Gateway API): the redirect's port, else the scheme's well-known one
    /// when the redirect sets a scheme, else the request's; a well-known port is left out.
    pub fn location(
        &self,
        scheme: &str,
        host: &str,
        port: Option<u16>,
        path: &str,
        query: Option<&str>,
        matched_prefix: Option<&str>,
    ) -> (StatusCode, String) {
        let scheme = self.scheme.as_deref().unwrap_or(scheme);
        let well_known = |s: &str| match s {
            "https" => Some(443),
            "http" => Some(80),
            _ => None,
        };
        let port = self.port.or(if self.scheme.is_some() {
            well_known(scheme)
        } else {
            port
        });
        let host = self.hostname.as_deref().unwrap_or(host);
        let path = self
            .path
            .as_ref()
            .map_or_else(|| path.to_string(), |m| m.apply(path, matched_prefix));
        let mut loc = format!("{scheme}://{host}");
        if let Some(p) = port.filter(|p| Some(*p) != well_known(scheme)) {
            loc.push_str(&format!(":{p}"));
        }
        loc.push_str(&path);
        if let Some(q) = query {
            loc.push('?');
            loc.push_str(q);
        }
        let status =
            StatusCode::from_u16(self.status_code.unwrap_or(302)).unwrap_or(StatusCode::FOUND);
        (status, loc)
    }
}

impl UrlRewrite {
    /// Rewrites the upstream Host and path in place.
    pub fn apply(&self, host: &mut String, path: &mut String, matched_prefix: Option<&str>) {
        if let Some(h) = &self.hostname {
            h.clone_into(host);
        }
        if let Some(m) = &self.path {
            *path = m.apply(path, matched_prefix);
        }
    }
}

impl RequestMirror {
    /// Whether this request is mirrored; `roll` is uniform in [0, 1).
    pub fn sampled(&self, roll: f64) -> bool {
        let share = match (&self.percent, &self.fraction) {
            (Some(p), _) => f64::from(*p) / 100.0,
            (None, Some(f)) => f64::from(f.numerator) / f64::from(f.denominator.max(1)),
            (None, None) => 1.0,
        };
        roll < share
    }
}
