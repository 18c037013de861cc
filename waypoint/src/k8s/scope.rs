//! Which Services use this waypoint, read as istiod reads it: the Service's
//! `istio.io/use-waypoint` label (with `istio.io/use-waypoint-namespace` when the waypoint
//! is in another namespace) or, when the Service has none, its Namespace's; `none` opts
//! out. A Service of another namespace counts only if this waypoint's Gateway lets its
//! namespace in (`allowedRoutes.namespaces` of the HBONE listener, Gateway API's default
//! `Same`). Services that istiod's state routes through this waypoint count as well, so
//! what istiod sends here always finds its namespace's routes and policies loaded.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{json, Value};

use crate::object::ObjectName;

pub const USE_WAYPOINT: &str = "istio.io/use-waypoint";
pub const USE_WAYPOINT_NAMESPACE: &str = "istio.io/use-waypoint-namespace";

pub type Labels = BTreeMap<String, String>;

/// A Kubernetes label selector (`matchLabels` and `matchExpressions`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LabelSelector {
    match_labels: Labels,
    /// (key, operator, values)
    match_expressions: Vec<(String, String, Vec<String>)>,
}

impl LabelSelector {
    fn parse(v: &Value) -> LabelSelector {
        let match_labels = v
            .get("matchLabels")
            .and_then(Value::as_object)
            .map(|m| {
                m.iter()
                    .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
                    .collect()
            })
            .unwrap_or_default();
        let match_expressions = v
            .get("matchExpressions")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .map(|e| {
                        let s = |k: &str| {
                            e.get(k)
                                .and_then(Value::as_str)
                                .unwrap_or_default()
                                .to_string()
                        };
                        let values = e.get("values").and_then(Value::as_array).map(|v| {
                            v.iter()
                                .filter_map(|x| x.as_str().map(String::from))
                                .collect()
                        });
                        (s("key"), s("operator"), values.unwrap_or_default())
                    })
                    .collect()
            })
            .unwrap_or_default();
        LabelSelector {
            match_labels,
            match_expressions,
        }
    }

    /// Kubernetes' semantics; an operator it does not know matches nothing.
    pub fn matches(&self, labels: &Labels) -> bool {
        self.match_labels
            .iter()
            .all(|(k, v)| labels.get(k) == Some(v))
            && self
                .match_expressions
                .iter()
                .all(|(k, op, values)| match op.as_str() {
                    "In" => labels.get(k).is_some_and(|v| values.contains(v)),
                    "NotIn" => labels.get(k).is_none_or(|v| !values.contains(v)),
                    "Exists" => labels.contains_key(k),
                    "DoesNotExist" => !labels.contains_key(k),
                    _ => false,
                })
    }
}

/// Which namespaces' Services may use the waypoint (its Gateway's HBONE listener).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum AllowedNamespaces {
    #[default]
    Same,
    All,
    Selector(LabelSelector),
}

impl AllowedNamespaces {
    /// From the Gateway object: the listener on 15008 with protocol HBONE (as istiod
    /// picks it); none, or no `allowedRoutes`, is `Same`.
    pub fn from_gateway(gateway: &Value) -> AllowedNamespaces {
        let listeners = gateway
            .pointer("/spec/listeners")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        let hbone = listeners.iter().find(|l| {
            l.get("protocol").and_then(Value::as_str) == Some("HBONE")
                && l.get("port").and_then(Value::as_u64) == Some(15008)
        });
        let Some(ns) = hbone.and_then(|l| l.pointer("/allowedRoutes/namespaces")) else {
            return AllowedNamespaces::Same;
        };
        match ns.get("from").and_then(Value::as_str) {
            Some("All") => AllowedNamespaces::All,
            Some("Selector") => AllowedNamespaces::Selector(LabelSelector::parse(
                ns.get("selector").unwrap_or(&Value::Null),
            )),
            _ => AllowedNamespaces::Same,
        }
    }

    fn name(&self) -> &'static str {
        match self {
            AllowedNamespaces::Same => "Same",
            AllowedNamespaces::All => "All",
            AllowedNamespaces::Selector(_) => "Selector",
        }
    }
}

/// What a `use-waypoint` label says.
#[derive(Debug, PartialEq, Eq)]
enum UseWaypoint {
    Unset,
    /// `none`: opted out (on a Service, even of its namespace's waypoint).
    Opted,
    Waypoint(ObjectName),
}

/// Istio's reading of the labels: the waypoint's namespace defaults to the object's own
/// (`default_ns`: the Service's namespace, or the Namespace's name).
fn use_waypoint(labels: &Labels, default_ns: &str) -> UseWaypoint {
    match labels.get(USE_WAYPOINT).map(String::as_str) {
        None => UseWaypoint::Unset,
        Some("none") => UseWaypoint::Opted,
        Some(name) => UseWaypoint::Waypoint(ObjectName {
            namespace: labels
                .get(USE_WAYPOINT_NAMESPACE)
                .cloned()
                .unwrap_or_else(|| default_ns.to_string()),
            name: name.to_string(),
        }),
    }
}

/// Who uses this waypoint, from what the Kubernetes API and istiod say.
#[derive(Debug, Default)]
pub struct Scope {
    /// This waypoint's Gateway.
    pub gateway: ObjectName,
    pub allowed: AllowedNamespaces,
    /// Every Namespace's labels.
    pub namespaces: BTreeMap<String, Labels>,
    /// The labels of the Services that carry `istio.io/use-waypoint` (any value).
    pub services: BTreeMap<ObjectName, Labels>,
    /// The Services istiod's state routes through this waypoint.
    pub from_istiod: BTreeSet<ObjectName>,
}

impl Scope {
    fn admits(&self, ns: &str) -> bool {
        match &self.allowed {
            AllowedNamespaces::All => true,
            AllowedNamespaces::Same => ns == self.gateway.namespace,
            AllowedNamespaces::Selector(s) => self.namespaces.get(ns).is_some_and(|l| s.matches(l)),
        }
    }

    /// Whether the labels make `svc` use this waypoint.
    pub fn labelled(&self, svc: &ObjectName) -> bool {
        let own = self
            .services
            .get(svc)
            .map_or(UseWaypoint::Unset, |l| use_waypoint(l, &svc.namespace));
        let chosen = match own {
            UseWaypoint::Unset => self
                .namespaces
                .get(&svc.namespace)
                .map_or(UseWaypoint::Unset, |l| use_waypoint(l, &svc.namespace)),
            other => other,
        };
        chosen == UseWaypoint::Waypoint(self.gateway.clone()) && self.admits(&svc.namespace)
    }

    /// Whether `svc` uses this waypoint (by its labels or by istiod's state).
    pub fn uses(&self, svc: &ObjectName) -> bool {
        self.from_istiod.contains(svc) || self.labelled(svc)
    }

    /// The Namespaces whose label makes their Services use this waypoint.
    fn labelled_namespaces(&self) -> Vec<&str> {
        self.namespaces
            .iter()
            .filter(|(ns, l)| {
                use_waypoint(l, ns) == UseWaypoint::Waypoint(self.gateway.clone())
                    && self.admits(ns)
            })
            .map(|(ns, _)| ns.as_str())
            .collect()
    }

    /// Labels that ask for this waypoint from a namespace its Gateway does not admit
    /// (istiod refuses those attachments too): `namespace` or `namespace/service`.
    pub fn refused(&self) -> Vec<String> {
        let wants = |l: &Labels, ns: &str| {
            use_waypoint(l, ns) == UseWaypoint::Waypoint(self.gateway.clone()) && !self.admits(ns)
        };
        let ns = self
            .namespaces
            .iter()
            .filter(|(ns, l)| wants(l, ns))
            .map(|(ns, _)| ns.clone());
        let svcs = self
            .services
            .iter()
            .filter(|(s, l)| wants(l, &s.namespace))
            .map(|(s, _)| format!("{}/{}", s.namespace, s.name));
        ns.chain(svcs).collect()
    }

    /// For the admin dump.
    pub fn dump(&self) -> Value {
        let labelled: Vec<String> = self
            .services
            .keys()
            .filter(|s| self.labelled(s))
            .map(|s| format!("{}/{}", s.namespace, s.name))
            .collect();
        json!({
            "allowedNamespaces": self.allowed.name(),
            "labelledNamespaces": self.labelled_namespaces(),
            "labelledServices": labelled,
            "servicesFromIstiod": self.from_istiod.iter().map(|s| format!("{}/{}", s.namespace, s.name)).collect::<Vec<_>>(),
            "refusedByGateway": self.refused(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(kv: &[(&str, &str)]) -> Labels {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn name(ns: &str, n: &str) -> ObjectName {
        ObjectName {
            namespace: ns.into(),
            name: n.into(),
        }
    }

    fn scope(allowed: AllowedNamespaces) -> Scope {
        let mut s = Scope {
            gateway: name("infra", "waypoint"),
            allowed,
            ..Scope::default()
        };
        s.namespaces
            .insert("infra".into(), labels(&[(USE_WAYPOINT, "waypoint")]));
        s.namespaces.insert(
            "shop".into(),
            labels(&[
                (USE_WAYPOINT, "waypoint"),
                (USE_WAYPOINT_NAMESPACE, "infra"),
                ("team", "a"),
            ]),
        );
        s.namespaces.insert("blog".into(), labels(&[("team", "b")]));
        s.namespaces
            .insert("elsewhere".into(), labels(&[(USE_WAYPOINT, "waypoint")]));
        // shop/legacy opts out; blog/api asks for us by its own labels; shop/pay names
        // a waypoint of its own namespace.
        s.services
            .insert(name("shop", "legacy"), labels(&[(USE_WAYPOINT, "none")]));
        s.services.insert(
            name("blog", "api"),
            labels(&[
                (USE_WAYPOINT, "waypoint"),
                (USE_WAYPOINT_NAMESPACE, "infra"),
            ]),
        );
        s.services
            .insert(name("shop", "pay"), labels(&[(USE_WAYPOINT, "waypoint")]));
        s
    }

    #[test]
    fn labels_as_istio_reads_them() {
        let s = scope(AllowedNamespaces::All);
        assert!(
            s.uses(&name("infra", "echo")),
            "our namespace's label, our namespace by default"
        );
        assert!(
            s.uses(&name("shop", "cart")),
            "inherited from a namespace naming us with use-waypoint-namespace"
        );
        assert!(
            !s.uses(&name("shop", "legacy")),
            "none opts the Service out"
        );
        assert!(
            !s.uses(&name("shop", "pay")),
            "its own label wins: shop/waypoint, not ours"
        );
        assert!(s.uses(&name("blog", "api")), "its own labels name us");
        assert!(!s.uses(&name("blog", "web")), "no label anywhere");
        assert!(
            !s.uses(&name("elsewhere", "x")),
            "names elsewhere/waypoint (its own namespace by default)"
        );
        assert!(!s.uses(&name("nowhere", "x")), "an unknown namespace");
        assert_eq!(s.labelled_namespaces(), ["infra", "shop"]);
    }

    #[test]
    fn the_gateway_decides_which_namespaces_may_attach() {
        let s = scope(AllowedNamespaces::Same);
        assert!(s.uses(&name("infra", "echo")));
        assert!(
            !s.uses(&name("shop", "cart")) && !s.uses(&name("blog", "api")),
            "Gateway API's default is Same"
        );
        assert_eq!(s.refused(), ["shop", "blog/api"]);
        let gw = json!({"spec": {"listeners": [{"name": "mesh", "port": 15008, "protocol": "HBONE",
            "allowedRoutes": {"namespaces": {"from": "Selector", "selector": {"matchExpressions": [{"key": "team", "operator": "In", "values": ["a"]}]}}}}]}});
        let mut s = scope(AllowedNamespaces::from_gateway(&gw));
        assert!(
            s.uses(&name("shop", "cart")) && !s.uses(&name("blog", "api")),
            "team=a only"
        );
        assert!(
            !s.uses(&name("infra", "echo")),
            "the selector applies to our own namespace too"
        );
        // istiod's word counts even where the labels say no.
        s.from_istiod.insert(name("blog", "api"));
        assert!(s.uses(&name("blog", "api")));
        let all = json!({"spec": {"listeners": [{"port": 15008, "protocol": "HBONE", "allowedRoutes": {"namespaces": {"from": "All"}}}]}});
        assert_eq!(
            AllowedNamespaces::from_gateway(&all),
            AllowedNamespaces::All
        );
        let other = json!({"spec": {"listeners": [{"port": 80, "protocol": "HTTP", "allowedRoutes": {"namespaces": {"from": "All"}}}]}});
        assert_eq!(
            AllowedNamespaces::from_gateway(&other),
            AllowedNamespaces::Same,
            "only the HBONE listener counts"
        );
    }

    #[test]
    fn selectors() {
        let sel = LabelSelector::parse(&json!({"matchLabels": {"a": "1"}, "matchExpressions": [
            {"key": "b", "operator": "NotIn", "values": ["x"]}, {"key": "c", "operator": "DoesNotExist"}]}));
        assert!(sel.matches(&labels(&[("a", "1")])));
        assert!(sel.matches(&labels(&[("a", "1"), ("b", "y")])));
        assert!(!sel.matches(&labels(&[("a", "1"), ("b", "x")])));
        assert!(!sel.matches(&labels(&[("a", "1"), ("c", "")])));
        assert!(!sel.matches(&labels(&[("a", "2")])));
        assert!(
            LabelSelector::parse(&json!({})).matches(&labels(&[])),
            "the empty selector matches everything"
        );
        assert!(!LabelSelector::parse(
            &json!({"matchExpressions": [{"key": "a", "operator": "Gt"}]})
        )
        .matches(&labels(&[("a", "1")])));
    }
}
