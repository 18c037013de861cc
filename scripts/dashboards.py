#!/usr/bin/env python3
"""The Grafana dashboards the charts ship, generated from the panel lists below:

  charts/ztunnel/files/dashboards/ztunnel.json    the panels of Istio's ztunnel dashboard
                                                  (versions, memory, CPU, connections,
                                                  bytes, DNS, xDS, workload manager,
                                                  sockets), plus failures and certificates
  charts/waypoint/files/dashboards/waypoint.json  HTTP rates, success, status codes,
                                                  latency and sizes; TCP; the process

Every query uses Istio's metric names as our binaries export them (docs/observability.md)
and selects the proxies by the `pod` label that a PodMonitor or Istio's Prometheus scrape
config adds; the `pod` variable lists the pods whose istio_build has component ztunnel
(or waypoint), so Envoy proxies reporting the same metrics are not mixed in.

  python3 scripts/dashboards.py          write the JSON files
  python3 scripts/dashboards.py --check  fail when a file differs from what this writes,
                                         or a dashboard is not valid (JSON, unique panel
                                         ids and uids, layout, variables, queries)
  python3 scripts/dashboards.py --metrics  print the metric names the dashboards query

tests/tests/e2e/waypoint.rs (dashboards_query_only_exported_metrics) scrapes both binaries after
traffic and checks that every metric a dashboard queries is exported.
"""
import json
import os
import re
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
DS = {"type": "prometheus", "uid": "${datasource}"}
RATE = "[$__rate_interval]"


def target(expr, legend="", **extra):
    t = {"datasource": DS, "expr": expr, "legendFormat": legend, "range": True}
    t.update(extra)
    return t


def timeseries(title, description, targets, unit="short", width=8, height=8, min_zero=False, axis_label=""):
    custom = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "showPoints": "never",
              "spanNulls": False, "axisLabel": axis_label, "axisSoftMin": 0 if min_zero else None}
    custom = {k: v for k, v in custom.items() if v is not None}
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DS,
        "fieldConfig": {"defaults": {"unit": unit, "custom": custom}, "overrides": []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": targets,
        "_size": (width, height),
    }


def stat(title, description, expr, unit, width=6, height=4, decimals=None, thresholds=None):
    defaults = {"unit": unit, "color": {"mode": "thresholds"},
                "thresholds": {"mode": "absolute", "steps": thresholds or [{"color": "green", "value": None}]}}
    if decimals is not None:
        defaults["decimals"] = decimals
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": DS,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                    "colorMode": "value", "graphMode": "area", "justifyMode": "auto",
                    "orientation": "auto", "textMode": "auto"},
        "targets": [target(expr, instant=False)],
        "_size": (width, height),
    }


def row(title, *panels):
    return (title, list(panels))


def pod_variable(component):
    q = f'label_values(istio_build{{component="{component}"}}, pod)'
    return {
        "name": "pod",
        "label": f"{component} pod",
        "type": "query",
        "datasource": DS,
        "definition": q,
        "query": {"query": q, "refId": "PrometheusVariableQueryEditor-VariableQuery", "qryType": 1},
        "refresh": 2,
        "sort": 1,
        "multi": True,
        "includeAll": True,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "options": [],
        "regex": "",
        "hide": 0,
    }


def datasource_variable():
    return {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
            "current": {}, "options": [], "refresh": 1, "regex": "", "hide": 0}


def dashboard(uid, title, description, rows, variables):
    panels, next_id, y = [], 1, 0
    for title_, items in rows:
        panels.append({"type": "row", "title": title_, "id": next_id, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        next_id += 1
        y += 1
        x, row_h = 0, 0
        for p in items:
            w, h = p.pop("_size")
            if x + w > 24:
                x, y, row_h = 0, y + row_h, 0
            p["id"] = next_id
            next_id += 1
            p["gridPos"] = {"h": h, "w": w, "x": x, "y": y}
            for i, t in enumerate(p["targets"]):
                t["refId"] = chr(ord("A") + i)
            panels.append(p)
            x += w
            row_h = max(row_h, h)
        y += row_h
    return {
        "annotations": {"list": []},
        "description": description,
        "editable": True,
        "graphTooltip": 1,
        "links": [],
        "panels": panels,
        "refresh": "15s",
        "schemaVersion": 39,
        "tags": ["istio", "ztunnel-rs"],
        "templating": {"list": [datasource_variable()] + variables},
        "time": {"from": "now-30m", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "title": title,
        "uid": uid,
        "version": 1,
    }


# ---------------------------------------------------------------------------------------
# ztunnel: Istio's ztunnel dashboard's rows and panels, on the metrics ztunnel exports.
def ztunnel():
    P = 'pod=~"$pod"'

    def per_pod(name, legend, op="rate", sign=""):
        inner = f"{op}({name}{{{P}}}{RATE})" if op else f"{name}{{{P}}}"
        return target(f"{sign}sum by (pod) ({inner})", f"{legend} ({{{{pod}}}})")

    rows = [
        row("Process",
            timeseries("Ztunnel Versions", "Running instances by version (istio_build)",
                       [target(f'sum by (tag) (istio_build{{component="ztunnel", {P}}})', "Version ({{tag}})")]),
            timeseries("Memory Usage", "Resident memory of each instance",
                       [per_pod("process_resident_memory_bytes", "Resident", op=None)], unit="bytes"),
            timeseries("CPU Usage", "CPU time used per second by each instance (cores)",
                       [per_pod("process_cpu_seconds_total", "CPU")], axis_label="cores", min_zero=True)),
        row("Network",
            timeseries("Connections", "Connections opened (up) and closed (down) per second per instance, "
                       "as each reporter (source and destination) counts them",
                       [per_pod("istio_tcp_connections_opened_total", "Opened"),
                        per_pod("istio_tcp_connections_closed_total", "Closed", sign="-")], unit="cps"),
            timeseries("Bytes Transmitted", "Bytes sent to and received from the connections' clients per instance",
                       [per_pod("istio_tcp_sent_bytes_total", "Sent"),
                        per_pod("istio_tcp_received_bytes_total", "Received")], unit="Bps"),
            timeseries("DNS Request", "DNS queries received by the DNS proxy per instance, and those forwarded upstream",
                       [per_pod("istio_dns_requests_total", "Request"),
                        per_pod("istio_dns_upstream_requests_total", "Upstream")], unit="qps")),
        row("Operations",
            timeseries("XDS Connections", "xDS connection terminations by reason. Typically one per instance "
                       "every 30 min (istiod's connection lifetime)",
                       [target(f"sum by (pod, reason) (rate(istio_xds_connection_terminations_total{{{P}}}{RATE}))",
                               "XDS Connection Terminations ({{pod}}, {{reason}})")]),
            timeseries("XDS Pushes", "xDS responses received, by type",
                       [target(f"sum by (url) (irate(istio_xds_message_total{{{P}}}{RATE}))", "{{url}}")], unit="ops"),
            timeseries("Workload Manager", "Active and pending proxies (enrolled pods) of each instance. Pending is "
                       "expected to converge to zero",
                       [per_pod("workload_manager_active_proxy_count", "Active Proxies", op=None),
                        per_pod("workload_manager_pending_proxy_count", "Pending Proxies", op=None)]),
            timeseries("Proxies Started / Stopped", "In-pod proxies started (up) and stopped (down) per instance "
                       "over each interval",
                       [per_pod("workload_manager_proxies_started_total", "Started", op="increase"),
                        per_pod("workload_manager_proxies_stopped_total", "Stopped", op="increase", sign="-")],
                       width=12),
            timeseries("XDS Config Received", "Bytes of xDS resources received, by type",
                       [target(f"sum by (url) (rate(istio_xds_message_bytes_total{{{P}}}{RATE}))", "{{url}}")],
                       unit="Bps", width=12)),
        row("Network Resources",
            timeseries("Resource Usage", "Open TCP connections (opened - closed, both reporters), open file "
                       "descriptors and open sockets per instance",
                       [target(f"sum by (pod) (istio_tcp_connections_opened_total{{{P}}}) - "
                               f"sum by (pod) (istio_tcp_connections_closed_total{{{P}}})", "TCP Connections ({{pod}})"),
                        per_pod("process_open_fds", "Open File Descriptors", op=None),
                        per_pod("istio_tcp_sockets_open", "Open Sockets", op=None)], width=24)),
        row("Failures and Certificates",
            timeseries("Connection Failures", "Connections that failed, by response flag (DENY: policy, "
                       "CONNECT: upstream unreachable, TLS_FAILURE: handshake)",
                       [target(f"sum by (pod, response_flags) (rate(istio_tcp_connections_failed_total{{{P}}}{RATE}))",
                               "{{response_flags}} ({{pod}})")], unit="cps"),
            timeseries("Refused Before Proxying", "Connections refused at accept (pod_limit, fd_exhaustion, "
                       "accept_error) and HBONE connections or requests rejected before policy",
                       [target(f"sum by (pod, reason) (rate(ztunnel_connections_refused_total{{{P}}}{RATE}))",
                               "refused {{reason}} ({{pod}})"),
                        target(f"sum by (pod, reason) (rate(ztunnel_hbone_rejections_total{{{P}}}{RATE}))",
                               "HBONE {{reason}} ({{pod}})")], unit="cps"),
            timeseries("Certificate Expiry", "Time until the nearest expiry of the workload certificates each "
                       "instance holds (rotated at half-life)",
                       [target(f"min by (pod) (ztunnel_certificate_nearest_expiry_seconds{{{P}}})",
                               "Nearest expiry ({{pod}})")], unit="s")),
    ]
    return dashboard("ztunnel-rs-ztunnel", "Ztunnel (ztunnel-rs)",
                     "ztunnel-rs node proxies: the panels of Istio's ztunnel dashboard on the metrics ztunnel-rs exports",
                     rows, [pod_variable("ztunnel")])


# ---------------------------------------------------------------------------------------
# waypoint: what Istio's workload and service dashboards show for reporter="waypoint".
def waypoint():
    W = 'reporter="waypoint", pod=~"$pod", destination_service=~"$destination_service"'
    P = 'pod=~"$pod"'

    def req(extra=""):
        return f"istio_requests_total{{{W}{extra}}}"

    def quantiles(name):
        return [target(f"histogram_quantile({q}, sum by (le) (rate({name}_bucket{{{W}}}{RATE})))", f"P{p}")
                for q, p in (("0.50", "50"), ("0.90", "90"), ("0.99", "99"))]

    all_, ok, flagged, grpc = req(), req(', response_code!~"5.."'), req(', response_flags!="-"'), req(', grpc_response_status!=""')
    r4xx, r5xx = req(', response_code=~"4.."'), req(', response_code=~"5.."')
    service_var = {
        "name": "destination_service",
        "label": "Service",
        "type": "query",
        "datasource": DS,
        "definition": 'label_values(istio_requests_total{reporter="waypoint", pod=~"$pod"}, destination_service)',
        "query": {"query": 'label_values(istio_requests_total{reporter="waypoint", pod=~"$pod"}, destination_service)',
                  "refId": "PrometheusVariableQueryEditor-VariableQuery", "qryType": 1},
        "refresh": 2,
        "sort": 1,
        "multi": True,
        "includeAll": True,
        # Also TCP-only services, which have no istio_requests_total series to list.
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "options": [],
        "regex": "",
        "hide": 0,
    }
    rows = [
        row("General",
            stat("Request Rate", "HTTP and gRPC requests per second through the selected waypoints",
                 f"round(sum(rate({all_}{RATE})), 0.01)", "reqps", decimals=2),
            stat("Success Rate", "Share of requests not answered with a 5xx",
                 f'sum(rate({ok}{RATE})) / sum(rate({all_}{RATE}))', "percentunit",
                 decimals=2, thresholds=[{"color": "red", "value": None}, {"color": "orange", "value": 0.95},
                                         {"color": "green", "value": 0.99}]),
            stat("4xx", "Requests per second answered with a 4xx",
                 f'round(sum(rate({r4xx}{RATE})), 0.01) or vector(0)', "reqps", decimals=2),
            stat("5xx", "Requests per second answered with a 5xx",
                 f'round(sum(rate({r5xx}{RATE})), 0.01) or vector(0)', "reqps", decimals=2,
                 thresholds=[{"color": "green", "value": None}, {"color": "red", "value": 0.01}])),
        row("HTTP Requests",
            timeseries("Requests by Service", "Requests per second by destination service",
                       [target(f"sum by (destination_service) (rate({all_}{RATE}))", "{{destination_service}}")],
                       unit="reqps", width=12),
            timeseries("Requests by Response Code", "Requests per second by response code (0: no response, "
                       "the client went away)",
                       [target(f"sum by (response_code) (rate({all_}{RATE}))", "{{response_code}}")],
                       unit="reqps", width=12),
            timeseries("Request Duration", "Request duration quantiles, from the request's first byte to the "
                       "response's last",
                       quantiles("istio_request_duration_milliseconds"), unit="ms"),
            timeseries("Request Duration by Service (P90)", "90th percentile request duration by destination service",
                       [target("histogram_quantile(0.90, sum by (le, destination_service) "
                               f"(rate(istio_request_duration_milliseconds_bucket{{{W}}}{RATE})))",
                               "{{destination_service}}")], unit="ms"),
            timeseries("Requests by Source", "Requests per second by source workload",
                       [target(f"sum by (source_workload, source_workload_namespace) (rate({all_}{RATE}))",
                               "{{source_workload}}.{{source_workload_namespace}}")], unit="reqps"),
            timeseries("Request Size", "Request size quantiles (headers and body)",
                       quantiles("istio_request_bytes"), unit="bytes"),
            timeseries("Response Size", "Response size quantiles (headers and body)",
                       quantiles("istio_response_bytes"), unit="bytes"),
            timeseries("Response Flags and gRPC Status", "Requests per second with a response flag (UF, UH, NR, "
                       "DC, ...) and gRPC calls by grpc-status",
                       [target(f'sum by (response_flags) (rate({flagged}{RATE}))',
                               "flag {{response_flags}}"),
                        target(f'sum by (grpc_response_status) (rate({grpc}{RATE}))',
                               "grpc-status {{grpc_response_status}}")], unit="reqps")),
        row("TCP",
            timeseries("TCP Connections", "TCP connections opened (up) and closed (down) per second by destination service",
                       [target(f"sum by (destination_service) (rate(istio_tcp_connections_opened_total{{{W}}}{RATE}))",
                               "Opened {{destination_service}}"),
                        target(f"-sum by (destination_service) (rate(istio_tcp_connections_closed_total{{{W}}}{RATE}))",
                               "Closed {{destination_service}}")], unit="cps"),
            timeseries("TCP Bytes", "Bytes sent to and received from clients per destination service",
                       [target(f"sum by (destination_service) (rate(istio_tcp_sent_bytes_total{{{W}}}{RATE}))",
                               "Sent {{destination_service}}"),
                        target(f"sum by (destination_service) (rate(istio_tcp_received_bytes_total{{{W}}}{RATE}))",
                               "Received {{destination_service}}")], unit="Bps"),
            timeseries("TCP Connection Failures", "Connections that failed, by response flag",
                       [target(f"sum by (response_flags) (rate(istio_tcp_connections_failed_total{{{W}}}{RATE}))",
                               "{{response_flags}}")], unit="cps")),
        row("Process",
            timeseries("Waypoint Versions", "Running waypoints by version (istio_build)",
                       [target(f'sum by (tag) (istio_build{{component="waypoint", {P}}})', "Version ({{tag}})")],
                       width=6),
            timeseries("Memory Usage", "Resident memory of each waypoint",
                       [target(f"sum by (pod) (process_resident_memory_bytes{{{P}}})", "Resident ({{pod}})")],
                       unit="bytes", width=6),
            timeseries("CPU Usage", "CPU time used per second by each waypoint (cores)",
                       [target(f"sum by (pod) (rate(process_cpu_seconds_total{{{P}}}{RATE}))", "CPU ({{pod}})")],
                       width=6, axis_label="cores", min_zero=True),
            timeseries("Config Updates", "xDS responses received from istiod (workloads, services), by type",
                       [target(f"sum by (url) (rate(istio_xds_message_total{{{P}}}{RATE}))", "{{url}}")],
                       unit="ops", width=6)),
    ]
    return dashboard("ztunnel-rs-waypoint", "Waypoint (ztunnel-rs)",
                     "ztunnel-rs waypoints: requests, latency and TCP under Istio's metric names (reporter=waypoint)",
                     rows, [pod_variable("waypoint"), service_var])


OUTPUTS = {
    "charts/ztunnel/files/dashboards/ztunnel.json": ztunnel,
    "charts/waypoint/files/dashboards/waypoint.json": waypoint,
}


def render(d):
    return json.dumps(d, indent=2, ensure_ascii=False) + "\n"


# A metric is a name written right before a `{` selector (every query selects by pod).
METRIC = re.compile(r"(?<![A-Za-z0-9_:$])([A-Za-z_:][A-Za-z0-9_:]*)\{")


def exprs(d):
    for p in d["panels"]:
        for t in p.get("targets", []):
            yield p, t["expr"]
    for v in d["templating"]["list"]:
        if v["type"] == "query":
            yield v, v["definition"]


def metrics(d):
    return sorted({m for _, e in exprs(d) for m in METRIC.findall(e)})


def validate(path, d):
    errors = []
    ids = [p["id"] for p in d["panels"]] + [c["id"] for p in d["panels"] for c in p.get("panels", [])]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        errors.append(f"duplicate panel ids {dup}")
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,40}", d.get("uid", "")):
        errors.append(f"uid {d.get('uid')!r}: Grafana wants at most 40 of [A-Za-z0-9_-]")
    names = {v["name"] for v in d["templating"]["list"]}
    cells = set()
    for p in d["panels"]:
        g = p["gridPos"]
        if g["x"] < 0 or g["w"] < 1 or g["x"] + g["w"] > 24:
            errors.append(f"panel {p['id']} {p['title']!r}: outside the 24-column grid")
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                if (x, y) in cells:
                    errors.append(f"panel {p['id']} {p['title']!r} overlaps another")
                    break
                cells.add((x, y))
            else:
                continue
            break
        if p["type"] == "row":
            continue
        if p.get("datasource") != DS or not p.get("targets"):
            errors.append(f"panel {p['id']} {p['title']!r}: needs the $datasource and at least one query")
        refs = [t.get("refId") for t in p.get("targets", [])]
        if len(set(refs)) != len(refs):
            errors.append(f"panel {p['id']} {p['title']!r}: duplicate refIds {refs}")
    for where, e in exprs(d):
        label = where.get("title") or where.get("name")
        for var in re.findall(r"\$(\w+)", e):
            if not var.startswith("__") and var not in names:
                errors.append(f"{label!r}: ${var} is not a dashboard variable")
        depth = {"(": 0, "{": 0, "[": 0}
        close = {")": "(", "}": "{", "]": "["}
        for ch in re.sub(r'"[^"]*"', '""', e):
            if ch in depth:
                depth[ch] += 1
            elif ch in close:
                depth[close[ch]] -= 1
                if depth[close[ch]] < 0:
                    break
        if any(depth.values()):
            errors.append(f"{label!r}: unbalanced brackets in {e}")
        if not METRIC.search(e):
            errors.append(f"{label!r}: no metric selector in {e}")
    return [f"{path}: {e}" for e in errors]


def main(argv):
    built = {path: gen() for path, gen in OUTPUTS.items()}
    if "--metrics" in argv:
        for path, d in built.items():
            for m in metrics(d):
                print(f"{path}\t{m}")
        return 0
    check = "--check" in argv
    errors = []
    uids = [d["uid"] for d in built.values()]
    if len(set(uids)) != len(uids):
        errors.append(f"dashboard uids are not unique: {uids}")
    for path, d in built.items():
        full = os.path.join(ROOT, path)
        want = render(d)
        if check:
            try:
                text = open(full, encoding="utf-8").read()
            except OSError as e:
                errors.append(f"{path}: {e}")
                continue
            if text != want:
                errors.append(f"{path}: differs from what scripts/dashboards.py writes (run it)")
            try:
                d = json.loads(text)
            except ValueError as e:
                errors.append(f"{path}: not valid JSON: {e}")
                continue
        else:
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "w", encoding="utf-8") as f:
                f.write(want)
        errors.extend(validate(path, d))
        panels = [p for p in d["panels"] if p["type"] != "row"]
        print(f"{path}: {len(panels)} panels, {len(metrics(d))} metrics: {' '.join(metrics(d))}")
    for e in errors:
        print(e, file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
