// Included by ztunnel's config_dump unit test too, so `//` comments: no inner attributes.
// A small JSON Schema checker for the schema keywords our test schemas use (`type`,
// `enum`, `required`, `properties`, `additionalProperties`, `items`, local `$ref`), so
// the config_dump shape can be checked without a large validator dependency.

use serde_json::Value;

/// Every violation of `schema` by `value`, as `path: what`.
pub fn violations(schema: &Value, value: &Value) -> Vec<String> {
    let mut out = Vec::new();
    check(schema, schema, value, "$", &mut out);
    out
}

fn type_ok(t: &str, v: &Value) -> bool {
    match t {
        "object" => v.is_object(),
        "array" => v.is_array(),
        "string" => v.is_string(),
        "boolean" => v.is_boolean(),
        "null" => v.is_null(),
        "number" => v.is_number(),
        "integer" => v.is_u64() || v.is_i64(),
        _ => false,
    }
}

fn check(root: &Value, schema: &Value, v: &Value, path: &str, out: &mut Vec<String>) {
    if let Some(r) = schema.get("$ref").and_then(Value::as_str) {
        let target = r
            .strip_prefix("#/")
            .map(|p| p.split('/').try_fold(root, |s, k| s.get(k)));
        match target.flatten() {
            Some(t) => check(root, t, v, path, out),
            None => out.push(format!("{path}: unresolvable $ref {r}")),
        }
        return;
    }
    if let Some(t) = schema.get("type") {
        let types: Vec<&str> = match t {
            Value::String(s) => vec![s.as_str()],
            Value::Array(a) => a.iter().filter_map(Value::as_str).collect(),
            _ => vec![],
        };
        if !types.iter().any(|t| type_ok(t, v)) {
            out.push(format!("{path}: {v} is not of type {t}"));
            return;
        }
    }
    if let Some(e) = schema.get("enum").and_then(Value::as_array) {
        if !e.contains(v) {
            out.push(format!(
                "{path}: {v} is not one of {}",
                Value::Array(e.clone())
            ));
        }
    }
    if let Some(obj) = v.as_object() {
        for r in schema
            .get("required")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
        {
            if !obj.contains_key(r) {
                out.push(format!("{path}: missing required field {r:?}"));
            }
        }
        let props = schema.get("properties").and_then(Value::as_object);
        for (k, child) in obj {
            let p = format!("{path}.{k}");
            match (
                props.and_then(|p| p.get(k)),
                schema.get("additionalProperties"),
            ) {
                (Some(s), _) => check(root, s, child, &p, out),
                (None, Some(Value::Bool(false))) => {
                    out.push(format!("{path}: unknown field {k:?}"))
                }
                (None, Some(s)) if s.is_object() => check(root, s, child, &p, out),
                _ => {}
            }
        }
    }
    if let (Some(items), Some(a)) = (schema.get("items"), v.as_array()) {
        for (i, child) in a.iter().enumerate() {
            check(root, items, child, &format!("{path}[{i}]"), out);
        }
    }
}
