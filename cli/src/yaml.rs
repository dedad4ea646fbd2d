//! `-o yaml`: the data `-o json` gives, as block YAML that every YAML
//! reader takes back as the same data. A string is written plain only when
//! no reader could take it for something else: one that YAML 1.1 readers
//! (PyYAML, the Kubernetes libraries) read as a boolean, a number, a date
//! or null (`yes`, `on`, `007`, `2024-01-01`, `~`) is double-quoted, as
//! is anything else that is not a plain word.

use serde_json::Value;

/// `value` (an array of items, as `get` lists them) as YAML.
pub fn to_string(value: &Value) -> String {
    let mut out = String::new();
    if is_empty_container(value) || !is_container(value) {
        out.push_str(&scalar(value));
        out.push('\n');
    } else {
        block(value, 0, &mut out);
    }
    out
}

/// The lines of a non-empty mapping or sequence at `indent`.
fn block(value: &Value, indent: usize, out: &mut String) {
    match value {
        Value::Object(map) => {
            for (key, v) in map {
                out.push_str(&" ".repeat(indent));
                entry(key, v, indent, out);
            }
        }
        Value::Array(items) => {
            for item in items {
                out.push_str(&" ".repeat(indent));
                out.push_str("- ");
                item_inline(item, indent + 2, out);
            }
        }
        _ => {}
    }
}

/// `key: value` (its first line from where the line is).
fn entry(key: &str, value: &Value, indent: usize, out: &mut String) {
    out.push_str(&string(key));
    out.push(':');
    match value {
        Value::Object(_) if !is_empty_container(value) => {
            out.push('\n');
            block(value, indent + 2, out);
        }
        Value::Array(_) if !is_empty_container(value) => {
            out.push('\n');
            block(value, indent, out);
        }
        _ => {
            out.push(' ');
            out.push_str(&scalar(value));
            out.push('\n');
        }
    }
}

/// A sequence item after its `- `: a mapping's first entry on that line,
/// the rest at `indent`.
fn item_inline(item: &Value, indent: usize, out: &mut String) {
    match item {
        Value::Object(map) if !map.is_empty() => {
            for (i, (key, v)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(&" ".repeat(indent));
                }
                entry(key, v, indent, out);
            }
        }
        Value::Array(items) if !items.is_empty() => {
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&" ".repeat(indent));
                }
                out.push_str("- ");
                item_inline(v, indent + 2, out);
            }
        }
        _ => {
            out.push_str(&scalar(item));
            out.push('\n');
        }
    }
}

fn is_container(value: &Value) -> bool {
    matches!(value, Value::Object(_) | Value::Array(_))
}

fn is_empty_container(value: &Value) -> bool {
    match value {
        Value::Object(map) => map.is_empty(),
        Value::Array(items) => items.is_empty(),
        _ => false,
    }
}

/// A scalar, or an empty mapping or sequence, on one line.
fn scalar(value: &Value) -> String {
    match value {
        Value::Null => "null".to_owned(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => string(s),
        Value::Object(_) => "{}".to_owned(),
        Value::Array(_) => "[]".to_owned(),
    }
}

/// Words YAML 1.1 readers take for booleans or null whatever their case.
const NOT_STRINGS: [&str; 12] = [
    "y", "n", "yes", "no", "on", "off", "true", "false", "null", "nan", "inf", "infinity",
];

/// `s` plain when it is a word no reader takes for anything but a string
/// (a letter, `_` or `/` first, then letters, digits and `_./-`), else
/// double-quoted with JSON's escapes, which YAML's double quotes share.
fn string(s: &str) -> String {
    let mut chars = s.chars();
    let plain = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == '/')
        && chars.all(|c| c.is_ascii_alphanumeric() || "_./-".contains(c))
        && !NOT_STRINGS.contains(&s.to_ascii_lowercase().as_str());
    if plain {
        s.to_owned()
    } else {
        serde_json::to_string(s).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    #[test]
    fn strings_other_readers_take_for_something_else_are_quoted() {
        let value = json!([{
            "id": "stage-a",
            "labels": {"approved": "yes", "gpu": "On", "since": "2024-01-01", "rack": "007",
                       "zone": "eu-west-1a", "note": "a b: c", "empty": "", "yes": "key"},
            "jobs": ["resnet", "~", "1e3"],
            "nack": null,
            "in_sync": true,
            "acked_version": 3,
            "stages": [],
            "limits": {},
            "nested": [[1, 2], {"a": [{"b": "c"}]}],
        }]);
        let text = super::to_string(&value);
        for line in [
            "approved: \"yes\"",
            "gpu: \"On\"",
            "since: \"2024-01-01\"",
            "rack: \"007\"",
            "zone: eu-west-1a",
            "note: \"a b: c\"",
            "\"yes\": key",
            "- \"~\"",
            "- \"1e3\"",
            "nack: null",
            "in_sync: true",
            "stages: []",
            "limits: {}",
        ] {
            assert!(text.contains(line), "{line} in:\n{text}");
        }
        let back: serde_json::Value = serde_yaml_ng::from_str(&text).unwrap();
        assert_eq!(back, value, "{text}");
        assert_eq!(super::to_string(&json!([])), "[]\n");
    }
}
