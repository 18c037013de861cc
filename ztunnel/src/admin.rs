//! Admin endpoint, bound to localhost in the proxy's own netns so pods can never reach
//! it: `GET /config_dump` (Istio ztunnel's JSON), `GET /logging` (current filter),
//! `POST /logging[?level=<levels>][&reset]` (Istio ztunnel's: see [`next_filter`]),
//! `POST /quitquitquit` (graceful drain, like SIGTERM).

pub mod config_dump;

use std::sync::Arc;

use http::{Method, Request, StatusCode};
use hyper::body::Incoming;
use tokio::net::TcpListener;
use tokio::sync::Notify;

use crate::http_endpoint::{self, text, HttpResponse};

/// Reads or replaces the log filter (e.g. `info`, `ztunnel::proxy=debug`).
pub trait LogControl: Send + Sync {
    fn get(&self) -> String;
    fn set(&self, filter: &str) -> Result<(), String>;
    /// The filter at start (RUST_LOG), which `reset` returns to.
    fn initial(&self) -> String {
        "info".into()
    }
}

const LOG_LEVELS: [&str; 6] = ["off", "error", "warn", "info", "debug", "trace"];

const LOGGING_HELP: &str = "usage: POST /logging                           (lists the current levels)
usage: POST /logging?level=<level>             (sets the default level)
usage: POST /logging?level=<scope>=<level>,... (sets scopes' levels, e.g. access=debug,proxy=trace)
usage: POST /logging?reset[&level=...]         (back to the start-up levels, then the given ones)
levels: off|error|warn|info|debug|trace; scopes: Istio's (access, proxy, xds, dns, hbone, inpod, ...) or module paths (ztunnel::proxy)
";

/// A scope as Istio names it, as the filter targets that carry it here: Istio's names
/// are ztunnel's modules (`proxy` is `ztunnel::proxy`); `access` is the access log.
/// The bare name is kept too, so an event with that exact target also matches.
fn scope_targets(scope: &str) -> Vec<String> {
    let module = match scope {
        "access" => Some("access_log"),
        "inpod" => Some("zds"),
        s if s.contains("::") || s.is_empty() => None,
        s => Some(s),
    };
    let mut t = vec![scope.to_string()];
    if let Some(m) = module {
        t.push(format!("ztunnel::{m}"));
    }
    t
}

/// Istio ztunnel's `/logging` semantics over a filter string: with neither `level` nor
/// `reset` (or an empty level without reset) nothing changes (None: just list); `level`
/// is `<level>` or `<scope>=<level>` clauses, merged over the current filter (or, with
/// `reset`, over the start-up filter). A bare scope (which would mean "trace") is
/// refused as upstream does.
pub fn next_filter(
    current: &str,
    initial: &str,
    level: Option<&str>,
    reset: bool,
) -> Result<Option<String>, String> {
    let level = level.unwrap_or_default().trim();
    if level.is_empty() && !reset {
        return Ok(None);
    }
    let mut clauses: Vec<(String, String)> = Vec::new();
    let mut default: Option<String> = None;
    let set = |target: &str, lvl: &str, clauses: &mut Vec<(String, String)>| {
        clauses.retain(|(t, _)| t != target);
        clauses.push((target.to_string(), lvl.to_string()));
    };
    // The base: clauses we can read back as target=level; anything else (span filters)
    // is kept as is.
    let base = if reset { initial } else { current };
    for c in base.split(',').map(str::trim).filter(|c| !c.is_empty()) {
        match c.split_once('=') {
            Some((t, l)) => set(t, l, &mut clauses),
            None if LOG_LEVELS.contains(&c.to_ascii_lowercase().as_str()) => {
                default = Some(c.to_ascii_lowercase())
            }
            None => clauses.push((c.to_string(), String::new())),
        }
    }
    for c in level.split(',').map(str::trim).filter(|c| !c.is_empty()) {
        match c.split_once('=') {
            Some((scope, l)) => {
                let l = l.trim().to_ascii_lowercase();
                if !LOG_LEVELS.contains(&l.as_str()) || scope.trim().is_empty() {
                    return Err(format!("invalid level {c:?}"));
                }
                for t in scope_targets(scope.trim()) {
                    set(&t, &l, &mut clauses);
                }
            }
            None if LOG_LEVELS.contains(&c.to_ascii_lowercase().as_str()) => {
                default = Some(c.to_ascii_lowercase())
            }
            None => {
                return Err(format!(
                    "level {c:?} is invalid (a level, or <scope>=<level>)"
                ))
            }
        }
    }
    let mut out: Vec<String> = clauses
        .into_iter()
        .map(|(t, l)| if l.is_empty() { t } else { format!("{t}={l}") })
        .collect();
    out.extend(default);
    Ok(Some(out.join(",")))
}

/// The query's parameters, percent-decoded (`+` is a space), by name; the first of a
/// repeated name wins.
fn query(req: &Request<Incoming>) -> std::collections::HashMap<String, String> {
    let mut params = std::collections::HashMap::new();
    for (k, v) in form_urlencoded::parse(req.uri().query().unwrap_or_default().as_bytes()) {
        params
            .entry(k.into_owned())
            .or_insert_with(|| v.into_owned());
    }
    params
}

fn logging(admin: &Admin, req: &Request<Incoming>) -> HttpResponse {
    let q = query(req);
    let current = admin.log.get();
    let next = match next_filter(
        &current,
        &admin.log.initial(),
        q.get("level").map(String::as_str),
        q.contains_key("reset"),
    ) {
        Ok(next) => next,
        Err(e) => return text(StatusCode::BAD_REQUEST, format!("{e}\n{LOGGING_HELP}")),
    };
    if let Some(filter) = next {
        if let Err(e) = admin.log.set(&filter) {
            return text(
                StatusCode::BAD_REQUEST,
                format!("invalid log filter {filter:?}: {e}\n{LOGGING_HELP}"),
            );
        }
        tracing::info!(filter = %filter, "log level changed");
    }
    text(
        StatusCode::OK,
        format!("current log level is {}\n", admin.log.get()),
    )
}

pub struct Admin {
    pub log: Box<dyn LogControl>,
    /// Notified by /quitquitquit; the binary then drains as on SIGTERM.
    pub quit: Arc<Notify>,
    /// Produces the /config_dump document.
    pub config_dump: Box<dyn Fn() -> serde_json::Value + Send + Sync>,
}

fn route(admin: &Admin, req: &Request<Incoming>) -> HttpResponse {
    match (req.method(), req.uri().path()) {
        (&Method::GET, "/config_dump") => {
            let body = serde_json::to_string_pretty(&(admin.config_dump)())
                .unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"));
            crate::http_endpoint::respond(StatusCode::OK, "application/json", body)
        }
        (&Method::GET, "/logging") => text(
            StatusCode::OK,
            format!("current log level is {}\n", admin.log.get()),
        ),
        (&Method::POST, "/logging") => logging(admin, req),
        (&Method::POST, "/quitquitquit") => {
            admin.quit.notify_one();
            text(StatusCode::OK, "draining\n".into())
        }
        (_, "/logging" | "/quitquitquit" | "/config_dump") => text(
            StatusCode::METHOD_NOT_ALLOWED,
            "method not allowed\n".into(),
        ),
        _ => text(
            StatusCode::NOT_FOUND,
            "not found; try /config_dump, /logging or /quitquitquit\n".into(),
        ),
    }
}

pub async fn serve(listener: TcpListener, admin: Arc<Admin>) {
    http_endpoint::serve(listener, "admin", move |req| route(&admin, req)).await
}

#[cfg(test)]
mod tests {
    use super::*;

    const START: &str = "info";

    #[test]
    fn empty_level_lists_instead_of_turning_logs_off() {
        assert_eq!(next_filter("info", START, None, false), Ok(None));
        assert_eq!(next_filter("info", START, Some(""), false), Ok(None));
        assert_eq!(next_filter("info", START, Some("  "), false), Ok(None));
    }

    #[test]
    fn levels_merge_over_the_current_filter() {
        assert_eq!(
            next_filter("info", START, Some("debug"), false),
            Ok(Some("debug".into()))
        );
        assert_eq!(
            next_filter("ztunnel::xds=warn,info", START, Some("access=debug"), false),
            Ok(Some(
                "ztunnel::xds=warn,access=debug,ztunnel::access_log=debug,info".into()
            ))
        );
        // Istio's scope names are ztunnel's modules.
        assert_eq!(
            next_filter("info", START, Some("proxy=trace,inpod=debug,warn"), false),
            Ok(Some(
                "proxy=trace,ztunnel::proxy=trace,inpod=debug,ztunnel::zds=debug,warn".into()
            ))
        );
        // A scope set again replaces its level; module paths stay as given.
        assert_eq!(
            next_filter(
                "ztunnel::proxy=trace,info",
                START,
                Some("ztunnel::proxy=error"),
                false
            ),
            Ok(Some("ztunnel::proxy=error,info".into()))
        );
    }

    #[test]
    fn reset_returns_to_the_start_up_filter() {
        assert_eq!(
            next_filter("ztunnel::proxy=trace,debug", "hickory=off,info", None, true),
            Ok(Some("hickory=off,info".into()))
        );
        assert_eq!(
            next_filter("debug", "info", Some("access=debug"), true),
            Ok(Some("access=debug,ztunnel::access_log=debug,info".into()))
        );
    }

    #[test]
    fn invalid_levels_are_refused() {
        for bad in ["loud", "proxy", "proxy=loud", "=debug"] {
            assert!(
                next_filter("info", START, Some(bad), false).is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn every_result_is_a_valid_env_filter() {
        for (level, reset) in [
            (Some("access=debug"), false),
            (Some("proxy=trace,warn"), true),
            (None, true),
        ] {
            let f = next_filter("ztunnel::xds=warn,info", START, level, reset)
                .unwrap()
                .unwrap();
            tracing_subscriber::EnvFilter::try_new(&f).unwrap();
        }
    }
}
