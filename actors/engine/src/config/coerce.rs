//! Numbers a configuration refuses though its parser takes them: a number with a fraction
//! given for an integer key (config-rs rounds it: `steps = 64.5` ran 65 steps, where serde
//! alone would refuse it), found by comparing the layers as given with what they became; and
//! an integer past what TOML holds (every checkpoint's manifest stores the configuration).

use serde_json::Value;

/// The first key (`[table] key = value`) where `source` (the layers as given) holds a number
/// with a fraction, or one that is not finite, and `parsed` (the configuration they made,
/// serialised) holds an integer.
pub(super) fn fraction_into_integer(source: &Value, parsed: &Value) -> Option<String> {
    walk(source, parsed, &mut Vec::new())
}

fn walk(source: &Value, parsed: &Value, path: &mut Vec<String>) -> Option<String> {
    match (source, parsed) {
        (Value::Object(s), Value::Object(p)) => s.iter().find_map(|(k, sv)| {
            let pv = p.get(k)?;
            path.push(k.clone());
            let found = walk(sv, pv, path);
            path.pop();
            found
        }),
        (Value::Array(s), Value::Array(p)) => {
            s.iter().zip(p).enumerate().find_map(|(i, (sv, pv))| {
                path.push(format!("{i}"));
                let found = walk(sv, pv, path);
                path.pop();
                found
            })
        }
        (Value::Number(s), Value::Number(p)) if p.is_i64() || p.is_u64() => {
            let x = s.as_f64()?;
            let fraction = s.is_f64() && (!x.is_finite() || x.fract() != 0.0);
            fraction.then(|| match &path[..] {
                [] => format!("{x}"),
                [key] => format!("{key} = {x}"),
                [table, rest @ ..] => format!("[{table}] {} = {x}", rest.join(".")),
            })
        }
        _ => None,
    }
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
    use super::fraction_into_integer;
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
}
