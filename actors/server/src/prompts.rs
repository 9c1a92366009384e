//! Prompts as clients write them: one [`Prompt`] (a text, or token ids) for a WebSocket
//! `generate`, and [`Prompts`] for `/v1/completions`, whose `prompt` may also be a batch, a
//! list of texts or a list of token-id lists, as OpenAI and vLLM accept it (each prompt gets
//! its own `n` choices, numbered prompt × `n` + choice). A value of no accepted form is an
//! error that says which forms are.

use serde::{Deserialize, Deserializer};
use serde_json::Value;

/// One prompt: text, or token ids.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    Ids(Vec<i64>),
}

/// The prompts of one `/v1/completions` request (one or a batch).
#[derive(Debug, Clone, PartialEq)]
pub struct Prompts(pub Vec<Prompt>);

/// The forms `/v1/completions` accepts, for errors.
const FORMS: &str = "a string, a list of token ids, a list of strings or a list of token-id lists";

impl<'de> Deserialize<'de> for Prompts {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Prompts::from_value(Value::deserialize(d)?).map_err(serde::de::Error::custom)
    }
}

impl<'de> Deserialize<'de> for Prompt {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = Value::deserialize(d)?;
        if let Value::Array(items) = &v
            && matches!(items.first(), Some(Value::String(_) | Value::Array(_)))
        {
            return Err(serde::de::Error::custom(
                "one prompt (a string or a list of token ids); a batch of prompts belongs to /v1/completions",
            ));
        }
        let mut p = Prompts::from_value(v).map_err(|e| {
            serde::de::Error::custom(e.replace(FORMS, "a string or a list of token ids"))
        })?;
        Ok(p.0.remove(0))
    }
}

impl Prompts {
    /// The prompts of a JSON `prompt` value, or what is wrong with it.
    pub fn from_value(v: Value) -> Result<Self, String> {
        let items = match v {
            Value::String(s) => return Ok(Prompts(vec![Prompt::Text(s)])),
            Value::Array(items) => items,
            other => return Err(format!("got {}; expected {FORMS}", kind(&other))),
        };
        let batch = match items.first() {
            None => return Err(format!("got an empty list; expected {FORMS}")),
            Some(Value::Number(_)) => return Ok(Prompts(vec![Prompt::Ids(ids(&items, "")?)])),
            Some(Value::String(_)) => items
                .into_iter()
                .enumerate()
                .map(|(i, x)| match x {
                    Value::String(s) => Ok(Prompt::Text(s)),
                    other => Err(format!("[{i}] is {} in a list of strings", kind(&other))),
                })
                .collect::<Result<_, _>>()?,
            Some(Value::Array(_)) => items
                .iter()
                .enumerate()
                .map(|(i, x)| match x {
                    Value::Array(a) if a.is_empty() => Err(format!("[{i}] is an empty list")),
                    Value::Array(a) => ids(a, &format!("[{i}]")).map(Prompt::Ids),
                    other => Err(format!(
                        "[{i}] is {} in a list of token-id lists",
                        kind(other)
                    )),
                })
                .collect::<Result<_, _>>()?,
            Some(other) => return Err(format!("got a list of {}; expected {FORMS}", kind(other))),
        };
        Ok(Prompts(batch))
    }
}

/// Token ids from JSON numbers (`at` names the list in errors).
fn ids(items: &[Value], at: &str) -> Result<Vec<i64>, String> {
    items
        .iter()
        .enumerate()
        .map(|(j, x)| {
            x.as_i64()
                .ok_or_else(|| format!("{at}[{j}] is {}, not a token id", kind(x)))
        })
        .collect()
}

fn kind(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(_) => "a boolean".into(),
        Value::Number(n) => format!("the number {n}"),
        Value::String(_) => "a string".into(),
        Value::Array(_) => "a list".into(),
        Value::Object(_) => "an object".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Value) -> Result<Vec<Prompt>, String> {
        Prompts::from_value(v).map(|p| p.0)
    }

    #[test]
    fn every_form_openai_accepts_reads_as_its_prompts() {
        assert_eq!(parse(json!("hi")), Ok(vec![Prompt::Text("hi".into())]));
        assert_eq!(parse(json!([5, 6])), Ok(vec![Prompt::Ids(vec![5, 6])]));
        assert_eq!(
            parse(json!(["a", "b"])),
            Ok(vec![Prompt::Text("a".into()), Prompt::Text("b".into())])
        );
        assert_eq!(
            parse(json!([[1, 2], [3]])),
            Ok(vec![Prompt::Ids(vec![1, 2]), Prompt::Ids(vec![3])])
        );
    }

    #[test]
    fn a_prompt_of_no_accepted_form_says_which_forms_are() {
        for (v, needle) in [
            (
                json!(7),
                "got the number 7; expected a string, a list of token ids",
            ),
            (json!([]), "got an empty list"),
            (json!([{"a": 1}]), "got a list of an object"),
            (json!(["a", 1]), "[1] is the number 1 in a list of strings"),
            (
                json!([[1], "a"]),
                "[1] is a string in a list of token-id lists",
            ),
            (json!([[1], []]), "[1] is an empty list"),
            (
                json!([[1, 2.5]]),
                "[0][1] is the number 2.5, not a token id",
            ),
            (json!([1, "x"]), "[1] is a string, not a token id"),
        ] {
            let e = parse(v.clone()).unwrap_err();
            assert!(e.contains(needle), "{v}: {e}");
        }
        // One prompt (a WebSocket generate): no batch, and the forms it takes.
        let one = |v: Value| serde_json::from_value::<Prompt>(v).map_err(|e| e.to_string());
        assert_eq!(one(json!([1, 2])), Ok(Prompt::Ids(vec![1, 2])));
        assert!(one(json!(["a"])).unwrap_err().contains("/v1/completions"));
        let e = one(json!(true)).unwrap_err();
        assert!(
            e.contains("expected a string or a list of token ids"),
            "{e}"
        );
    }
}
