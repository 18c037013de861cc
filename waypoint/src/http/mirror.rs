//! Request mirroring: a copy of the request goes to each mirror backend and is
//! forgotten (Envoy's shadowing).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::BodyExt;

use super::authority::Authority;
use super::backend::{Backend, Origin};
use super::body::full;
use super::headers::clone_parts;
use super::plan::{set_head_for, Mirrors};
use crate::config::Config;
use crate::context::Waypoint;
use crate::route;
use crate::upstream::{Endpoint, UpstreamError};

/// Mirrored requests in flight at once; more are skipped.
pub const MAX_MIRRORS_IN_FLIGHT: usize = 256;
const MIRROR_TIMEOUT: Duration = Duration::from_secs(10);
/// A mirror's response is read (to reuse its connection) up to this size, then dropped.
const MIRROR_MAX_RESPONSE: usize = 1 << 20;

/// Sends the request (head as planned, `body` buffered) to every mirror of the plan.
pub fn mirror_all(
    wp: &Arc<Waypoint>,
    cfg: &Config,
    mirrors: &Mirrors<'_>,
    parts: &http::request::Parts,
    body: &Bytes,
) {
    for m in &mirrors.to {
        mirror(wp, cfg, mirrors, m, parts, body.clone());
    }
}

/// Sends a copy of the request to the mirror backend and forgets it (Envoy's shadowing:
/// the Host gets a `-shadow` suffix, the response is dropped).
fn mirror(
    wp: &Arc<Waypoint>,
    cfg: &Config,
    mirrors: &Mirrors<'_>,
    m: &route::RequestMirror,
    parts: &http::request::Parts,
    body: Bytes,
) {
    let &Mirrors {
        ref host,
        port,
        route_ns,
        route_kind,
        client_http2,
        ..
    } = mirrors;
    if !m.sampled(rand::random::<f64>()) {
        return;
    }
    let name = m.service(route_ns.unwrap_or_default());
    if !crate::grant::permitted(&cfg.grants, route_kind, route_ns.unwrap_or_default(), &name) {
        return tracing::debug!(backend = %format!("{}/{}", name.namespace, name.name), "mirror backend in another namespace without a ReferenceGrant");
    }
    let svc = match crate::egress::backend_service(
        &cfg.state,
        route_ns.unwrap_or_default(),
        &m.backend_ref,
    ) {
        Ok(svc) => svc,
        Err(e) => return tracing::debug!(error = %e, "mirror backend not found"),
    };
    let from = Origin {
        me: wp.me_in(cfg),
        target: Some(mirrors.target),
        root_namespace: &wp.root_namespace,
    };
    let mut backend = Backend::service(
        cfg,
        &from,
        svc,
        m.backend_ref.port.unwrap_or(port),
        m.subset.as_deref(),
    );
    let http2 = crate::destination::connection::upstream_http2(
        backend.policy.as_ref().and_then(|p| p.protocol),
        cfg.h2_upgrade,
        backend.http2,
        client_http2,
    );
    let mut parts = clone_parts(parts);
    let shadow = format!("{host}-shadow");
    let pq = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "/".into());
    if backend.policy.as_ref().is_some_and(|p| p.refused.is_some()) {
        return tracing::debug!(backend = %format!("{}/{}", name.namespace, name.name), "mirror skipped: its DestinationRule cannot be applied");
    }
    let Ok(shadow) = Authority::parse(&shadow) else {
        return tracing::debug!(host = %shadow, "mirror skipped: the shadow host is no authority");
    };
    if set_head_for(&mut parts, &shadow, &pq, http2).is_err() {
        return tracing::debug!(host = %shadow, "mirror skipped: the shadow host makes no URI");
    }
    // Mirrors are best effort and must not pile up behind a slow mirror backend.
    let Ok(slot) = wp.mirror_slots.clone().try_acquire_owned() else {
        return tracing::debug!("mirror skipped: too many mirrored requests in flight");
    };
    let wp = wp.clone();
    tokio::spawn(async move {
        let _slot = slot;
        if let Err(e) = backend.resolve(&wp.resolver, &wp.me).await {
            return tracing::debug!(error = %e, "mirror skipped: no endpoint");
        }
        let Some(picked) = wp.balancer.pick(&backend.endpoints, &[]) else {
            return;
        };
        let mut ep = Endpoint::of(
            &wp.config.load().state,
            picked.addr,
            &picked.workload,
            backend.service.as_deref(),
        );
        ep.tls = backend.tls_target(Some(shadow.as_str()), picked.addr.ip(), http2);
        ep.reuse = backend.policy.as_ref().map(|t| t.reuse).unwrap_or_default();
        let exchange = async {
            let resp = wp
                .upstreams
                .send(&ep, http2, Request::from_parts(parts, full(body)))
                .await?;
            // Read (and drop) the response so the connection can be reused, up to a cap.
            let mut body = resp.into_body();
            let mut read = 0usize;
            while let Some(Ok(frame)) = body.frame().await {
                read += frame.data_ref().map_or(0, |d| d.len());
                if read > MIRROR_MAX_RESPONSE {
                    break;
                }
            }
            Ok::<_, UpstreamError>(())
        };
        match tokio::time::timeout(MIRROR_TIMEOUT, exchange).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::debug!(error = %e, "mirrored request failed"),
            Err(_) => tracing::debug!("mirrored request timed out"),
        }
    });
}
