//! Connection limits: every connection is counted for the process's drain and for its
//! pod's removal, and a pod may have at most `max_connections_per_pod` open.

use super::inputs::ProxyInputs;
use super::pod::LocalPod;

/// Counts a connection both for the process's drain and for its pod's removal; None
/// (counted as refused) when the pod already has `max_connections_per_pod` open.
pub(crate) fn track(
    inputs: &ProxyInputs,
    pod: &LocalPod,
) -> Option<(crate::drain::ActiveGuard, crate::drain::ActiveGuard)> {
    let max = inputs.cfg.max_connections_per_pod;
    if max > 0 && pod.active.active() >= max {
        inputs.metrics.connection_refused("pod_limit");
        tracing::warn!(pod = %pod.workload.name, max, "pod connection limit reached; refusing");
        return None;
    }
    Some((inputs.drain.track(), pod.active.track()))
}
