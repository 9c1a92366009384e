//! Values a configuration refuses though its parser takes them, found by comparing the layers
//! as given with what they became: a number with a fraction given for an integer key
//! (config-rs rounds it: `steps = 64.5` ran 65 steps, where serde alone would refuse it) and a
//! string given for a boolean or number key (config-rs reads `"yes"` as `true`); and an
//! integer past what TOML holds (every checkpoint's manifest stores the configuration).

use serde_json::Value;

/// The first key (`[table] key = value`) where `source` (the layers as given) holds a number
/// with a fraction, or one that is not finite, and `parsed` (the configuration they made,
/// serialised) holds an integer.
pub(super) fn fraction_into_integer(source: &Value, parsed: &Value) -> Option<String> {
    walk(source, parsed, &mut Vec::new(), &|s, p, at| match (s, p) {
        (Value::Number(s), Value::Number(p)) if p.is_i64() || p.is_u64() => {
            let x = s.as_f64()?;
            let fraction = s.is_f64() && (!x.is_finite() || x.fract() != 0.0);
            fraction.then(|| at(&x.to_string()))
        }
        _ => None,
    })
}

/// The first key where `source` holds a string and `parsed` a boolean or a number (config-rs
/// reads `async_checkpoint = "yes"` as `true` and `steps = "5"` as 5, where TOML and serde
/// would refuse both), with what the key takes.
pub(super) fn string_into_scalar(source: &Value, parsed: &Value) -> Option<(String, &'static str)> {
    walk(source, parsed, &mut Vec::new(), &|s, p, at| match (s, p) {
        (Value::String(v), Value::Bool(_)) => Some((at(&format!("{v:?}")), "`true` or `false`")),
        (Value::String(v), Value::Number(_)) => Some((at(&format!("{v:?}")), "a number")),
        _ => None,
    })
}

/// What [`walk`] asks of a leaf pair: something found at it, given a formatter of its key
/// with a value.
type Leaf<'a, T> = &'a dyn Fn(&Value, &Value, &dyn Fn(&str) -> String) -> Option<T>;

/// `[table] key = value` for the key at `path`.
fn key(path: &[String], value: &str) -> String {
    match path {
        [] => value.to_string(),
        [key] => format!("{key} = {value}"),
        [table, rest @ ..] => format!("[{table}] {} = {value}", rest.join(".")),
    }
}

/// The first leaf pair (the same key in `source` and `parsed`) that `leaf` finds something
/// at; `leaf` gets a formatter of the key with a value.
fn walk<T>(source: &Value, parsed: &Value, path: &mut Vec<String>, leaf: Leaf<'_, T>) -> Option<T> {
    match (source, parsed) {
        (Value::Object(s), Value::Object(p)) => s.iter().find_map(|(k, sv)| {
            let pv = p.get(k)?;
            path.push(k.clone());
            let found = walk(sv, pv, path, leaf);
            path.pop();
            found
        }),
        (Value::Array(s), Value::Array(p)) => {
            s.iter().zip(p).enumerate().find_map(|(i, (sv, pv))| {
                path.push(format!("{i}"));
                let found = walk(sv, pv, path, leaf);
                path.pop();
                found
            })
        }
        _ => leaf(source, parsed, &|v| key(path, v)),
    }
}

/// `[table] key = value` for the first null in `source` (the layers as given, through JSON): a
/// float that is not finite (TOML's `nan`, `inf`), which JSON cannot hold (TOML has no null);
/// `value` reads it from the layers by its dotted key. serde would say "got null" of it.
pub(super) fn non_finite(source: &Value, value: &dyn Fn(&str) -> Option<f64>) -> Option<String> {
    let path = null_at(source)?;
    let v = value(&path.join(".")).map_or("nan".into(), |x| x.to_string());
    Some(key(&path, &v))
}

/// The key path of the first null in `v`.
fn null_at(v: &Value) -> Option<Vec<String>> {
    let (k, rest) = match v {
        Value::Null => return Some(Vec::new()),
        Value::Object(m) => m.iter().find_map(|(k, v)| Some((k.clone(), null_at(v)?)))?,
        Value::Array(a) => {
            (a.iter().enumerate()).find_map(|(i, v)| Some((i.to_string(), null_at(v)?)))?
        }
        _ => return None,
    };
    Some(std::iter::once(k).chain(rest).collect())
}

/// The path of the first integer past `i64::MAX` in `v`.
pub(super) fn past_i64_max(v: &serde_json::Value, path: &str) -> Option<String> {
    match v {
        serde_json::Value::Number(n) => n
            .as_u64()
            .filter(|&x| x > i64::MAX as u64)
            .map(|x| format!("[{path}] = {x}")),
        serde_json::Value::Object(m) => m.iter().find_map(|(k, v)| {
            past_i64_max(
                v,
                &if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                },
            )
        }),
        serde_json::Value::Array(a) => a
            .iter()
            .enumerate()
            .find_map(|(i, v)| past_i64_max(v, &format!("{path}[{i}]"))),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::{fraction_into_integer, string_into_scalar};
    use serde_json::json;

    #[test]
    fn a_fraction_where_an_integer_landed_is_named_by_its_key() {
        let parsed = json!({"train": {"steps": 65, "lr": 0.5, "devices": [0, 1]}});
        let found = |source| fraction_into_integer(&source, &parsed);
        assert_eq!(
            found(json!({"train": {"steps": 64.5}})).as_deref(),
            Some("[train] steps = 64.5")
        );
        // A whole number written as a float is that integer; floats for float keys are fine.
        assert_eq!(found(json!({"train": {"steps": 65.0, "lr": 0.5}})), None);
        assert_eq!(found(json!({"train": {"steps": 65}})), None);
        assert_eq!(
            found(json!({"train": {"devices": [0, 1.5]}})).as_deref(),
            Some("[train] devices.1 = 1.5")
        );
    }

    #[test]
    fn a_string_where_a_boolean_or_number_landed_is_named_by_its_key() {
        let parsed = json!({"train": {"async_checkpoint": true, "steps": 5, "out_dir": "run"}});
        let found = |source| string_into_scalar(&source, &parsed);
        assert_eq!(
            found(json!({"train": {"async_checkpoint": "yes"}})),
            Some((
                "[train] async_checkpoint = \"yes\"".to_string(),
                "`true` or `false`"
            ))
        );
        assert_eq!(
            found(json!({"train": {"steps": "5"}})),
            Some(("[train] steps = \"5\"".to_string(), "a number"))
        );
        assert_eq!(
            found(json!({"train": {"async_checkpoint": true, "out_dir": "run"}})),
            None
        );
    }
}
