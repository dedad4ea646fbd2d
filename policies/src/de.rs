//! A serde `Deserializer` over the positioned [`Node`] tree, so that the
//! document types can be plain `#[derive(Deserialize)]` structs with
//! `deny_unknown_fields` while every error still lands on the line and
//! column of the node that caused it, with the field path and a sentence
//! in the operator's words ("a whole number", not "i64").

use std::fmt;
use std::sync::Arc;

use serde::de::{self, DeserializeSeed, Expected, IntoDeserializer, Unexpected, Visitor};

use crate::error::{ErrorKind, Location, PolicyError, suggest};
use crate::yaml::{Node, Pos, Resolved, Value};

/// Deserialises a `T` from `node`, naming fields below `path`.
pub(crate) fn from_node<T: de::DeserializeOwned>(node: &Node, path: &str) -> Result<T, DeError> {
    T::deserialize(NodeDe {
        node,
        path: path.to_owned(),
    })
}

/// A deserialisation error; position and path are filled in by the
/// innermost node it passes through.
#[derive(Debug)]
pub(crate) struct DeError {
    at: Option<Pos>,
    path: Option<String>,
    raw: Raw,
}

#[derive(Debug)]
enum Raw {
    UnknownField {
        field: String,
        expected: &'static [&'static str],
    },
    MissingField(&'static str),
    WrongType {
        expected: String,
        found: String,
    },
    UnknownValue {
        found: String,
        expected: &'static [&'static str],
    },
    Custom(String),
}

impl DeError {
    fn locate(mut self, at: Pos, path: &str) -> Self {
        if self.at.is_none() {
            self.at = Some(at);
            self.path = Some(path.to_owned());
        }
        self
    }

    /// Turns the error into a [`PolicyError`] in `source`.
    pub(crate) fn into_policy_error(self, source: &Arc<str>) -> PolicyError {
        let path = match self.path.as_deref() {
            None | Some("") => "the document".to_owned(),
            Some(p) => p.to_owned(),
        };
        let kind = match self.raw {
            Raw::UnknownField { field, expected } => ErrorKind::UnknownField {
                suggestion: suggest(&field, expected.iter().copied()),
                field,
                path,
                expected: expected.iter().map(|s| (*s).to_owned()).collect(),
            },
            Raw::MissingField(field) => ErrorKind::MissingField {
                field: field.to_owned(),
                hint: missing_hint(&path, field),
                path,
            },
            Raw::WrongType { expected, found } => ErrorKind::WrongType {
                path,
                expected,
                found,
            },
            Raw::UnknownValue { found, expected } => ErrorKind::UnknownValue {
                suggestion: suggest(&found, expected.iter().copied()),
                found,
                path,
                expected: expected.iter().map(|s| (*s).to_owned()).collect(),
            },
            Raw::Custom(message) => ErrorKind::InvalidValue { path, message },
        };
        PolicyError {
            location: Location::new(source, self.at.unwrap_or_default()),
            kind,
        }
    }
}

impl fmt::Display for DeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.raw)
    }
}

impl std::error::Error for DeError {}

impl de::Error for DeError {
    fn custom<T: fmt::Display>(msg: T) -> Self {
        Self::new(Raw::Custom(msg.to_string()))
    }

    fn invalid_type(unexp: Unexpected<'_>, exp: &dyn Expected) -> Self {
        Self::new(Raw::WrongType {
            expected: expected_text(exp),
            found: unexpected_text(&unexp),
        })
    }

    fn invalid_value(unexp: Unexpected<'_>, exp: &dyn Expected) -> Self {
        Self::invalid_type(unexp, exp)
    }

    fn unknown_variant(variant: &str, expected: &'static [&'static str]) -> Self {
        Self::new(Raw::UnknownValue {
            found: variant.to_owned(),
            expected,
        })
    }

    fn unknown_field(field: &str, expected: &'static [&'static str]) -> Self {
        Self::new(Raw::UnknownField {
            field: field.to_owned(),
            expected,
        })
    }

    fn missing_field(field: &'static str) -> Self {
        Self::new(Raw::MissingField(field))
    }
}

impl DeError {
    fn new(raw: Raw) -> Self {
        Self {
            at: None,
            path: None,
            raw,
        }
    }
}

/// What serde's `Expected` means, in an operator's words.
fn expected_text(exp: &dyn Expected) -> String {
    let text = exp.to_string();
    match text.as_str() {
        "i8" | "i16" | "i32" | "i64" | "u8" | "u16" | "u32" | "u64" | "usize" | "isize" => {
            "a whole number".to_owned()
        }
        "a boolean" => "`true` or `false`".to_owned(),
        "a string" => "a string (quote it if it looks like a number)".to_owned(),
        "a map" => "a mapping of `key: value` lines".to_owned(),
        "a sequence" => "a list".to_owned(),
        t if t.starts_with("struct ") => "a mapping of `key: value` lines".to_owned(),
        t if t.starts_with("enum ") => "one word".to_owned(),
        _ => text,
    }
}

fn unexpected_text(unexp: &Unexpected<'_>) -> String {
    match unexp {
        Unexpected::Bool(b) => format!("`{b}`"),
        Unexpected::Unsigned(n) => format!("the number {n}"),
        Unexpected::Signed(n) => format!("the number {n}"),
        // Past 2^53 a float no longer holds the number written (YAML reads
        // a huge whole number as one): do not quote a different number.
        Unexpected::Float(n) if n.abs() >= 9_007_199_254_740_992.0 => {
            "a number too large to read exactly".to_owned()
        }
        // `1e3` or `1000.0`: YAML reads a float, whole as it is.
        Unexpected::Float(n) if n.fract() == 0.0 => {
            format!(
                "{n} written with a decimal point or an exponent (write whole numbers with digits only)"
            )
        }
        Unexpected::Float(n) => format!("the number {n}"),
        Unexpected::Str(s) => format!("the string `{s}`"),
        Unexpected::Unit => "nothing (an empty value)".to_owned(),
        Unexpected::Seq => "a list".to_owned(),
        Unexpected::Map => "a mapping".to_owned(),
        other => other.to_string(),
    }
}

/// What to add for a missing required field.
fn missing_hint(path: &str, field: &str) -> String {
    match (path, field) {
        (_, "apiVersion") => "write `apiVersion: sluice.dev/v1`".into(),
        (_, "kind") => "write `kind: StoragePool` or `kind: JobPolicy`".into(),
        (_, "metadata") => "add `metadata:` with a `name:`".into(),
        (_, "name") => "add a name such as `name: team-a` (lowercase letters, digits and `-`)".into(),
        (_, "spec") => "add a `spec:` mapping".into(),
        (_, "capacity") => "add `capacity:` with the pool's `bandwidth:`, e.g. `bandwidth: 2GiB/s`".into(),
        ("spec.capacity", "bandwidth") => "write what the storage delivers, e.g. `bandwidth: 2GiB/s`".into(),
        (_, "selector") => "add `selector:` with `matchLabels:` or `matchExpressions:`; `selector: {}` selects every job".into(),
        (_, "pool") => "name the StoragePool these jobs use, e.g. `pool: shared`".into(),
        (_, "key") => "name the job label this requirement tests, e.g. `key: team`".into(),
        (_, "operator") => "write `operator: In`, `NotIn`, `Exists` or `DoesNotExist`".into(),
        _ => format!("add `{field}:`"),
    }
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_owned()
    } else {
        format!("{path}.{key}")
    }
}

struct NodeDe<'a> {
    node: &'a Node,
    path: String,
}

impl NodeDe<'_> {
    fn unexpected(&self) -> Unexpected<'_> {
        match &self.node.value {
            Value::Seq(_) => Unexpected::Seq,
            Value::Map(_) => Unexpected::Map,
            Value::Scalar { .. } => match self.node.resolve() {
                Some(Resolved::Null) | None => Unexpected::Unit,
                Some(Resolved::Bool(b)) => Unexpected::Bool(b),
                Some(Resolved::Int(i)) => Unexpected::Signed(i),
                Some(Resolved::Float(f)) => Unexpected::Float(f),
                Some(Resolved::Str(s)) => Unexpected::Str(s),
            },
        }
    }

    /// The scalar's text when it is a non-null scalar. Plain scalars that
    /// look like numbers or booleans are still accepted where a string is
    /// expected (`version: 2` in labels), with their text as written.
    fn text(&self) -> Option<&str> {
        match &self.node.value {
            Value::Scalar { text, .. } if !self.node.is_null() => Some(text),
            _ => None,
        }
    }
}

impl<'de> de::Deserializer<'de> for NodeDe<'_> {
    type Error = DeError;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        let (at, path) = (self.node.at, self.path.clone());
        let result = match &self.node.value {
            Value::Seq(items) => visitor.visit_seq(SeqDe {
                items: items.iter(),
                index: 0,
                path: &self.path,
            }),
            Value::Map(entries) => visitor.visit_map(MapDe {
                entries: entries.iter(),
                value: None,
                path: &self.path,
            }),
            Value::Scalar { .. } => match self.node.resolve() {
                Some(Resolved::Null) | None => visitor.visit_unit(),
                Some(Resolved::Bool(b)) => visitor.visit_bool(b),
                Some(Resolved::Int(i)) => visitor.visit_i64(i),
                Some(Resolved::Float(f)) => visitor.visit_f64(f),
                Some(Resolved::Str(s)) => visitor.visit_str(s),
            },
        };
        result.map_err(|e| e.locate(at, &path))
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        if self.node.is_null() {
            visitor.visit_none()
        } else {
            visitor.visit_some(self)
        }
    }

    fn deserialize_str<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        let result = match self.text() {
            Some(text) => visitor.visit_str(text),
            None => Err(de::Error::invalid_type(self.unexpected(), &visitor)),
        };
        result.map_err(|e: DeError| e.locate(self.node.at, &self.path))
    }

    fn deserialize_string<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        self.deserialize_str(visitor)
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, DeError> {
        let result = match self.text() {
            Some(text) => visitor.visit_enum(text.into_deserializer()),
            None => Err(de::Error::invalid_type(self.unexpected(), &visitor)),
        };
        result.map_err(|e: DeError| e.locate(self.node.at, &self.path))
    }

    /// An empty value where a mapping belongs (`prefetch:` with every
    /// line below commented out) reads as an empty mapping, as in
    /// Kubernetes: optional fields take their defaults and required ones
    /// are reported missing.
    fn deserialize_map<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, DeError> {
        if !self.node.is_null() {
            return self.deserialize_any(visitor);
        }
        visitor
            .visit_map(MapDe {
                entries: [].iter(),
                value: None,
                path: &self.path,
            })
            .map_err(|e: DeError| e.locate(self.node.at, &self.path))
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, DeError> {
        self.deserialize_map(visitor)
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char
        bytes byte_buf unit unit_struct newtype_struct seq tuple
        tuple_struct identifier ignored_any
    }
}

struct SeqDe<'a, 'p> {
    items: std::slice::Iter<'a, Node>,
    index: usize,
    path: &'p str,
}

impl<'de> de::SeqAccess<'de> for SeqDe<'_, '_> {
    type Error = DeError;

    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, DeError> {
        let Some(node) = self.items.next() else {
            return Ok(None);
        };
        let path = format!("{}[{}]", self.path, self.index);
        self.index += 1;
        seed.deserialize(NodeDe { node, path }).map(Some)
    }
}

struct MapDe<'a, 'p> {
    entries: std::slice::Iter<'a, (crate::yaml::Key, Node)>,
    value: Option<(&'a str, &'a Node)>,
    path: &'p str,
}

impl<'de> de::MapAccess<'de> for MapDe<'_, '_> {
    type Error = DeError;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, DeError> {
        let Some((key, value)) = self.entries.next() else {
            return Ok(None);
        };
        self.value = Some((&key.text, value));
        let de: de::value::StrDeserializer<'_, DeError> = key.text.as_str().into_deserializer();
        seed.deserialize(de)
            .map(Some)
            .map_err(|e| e.locate(key.at, self.path))
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, DeError> {
        let (key, node) = self
            .value
            .take()
            .ok_or_else(|| de::Error::custom("value requested before its key"))?;
        seed.deserialize(NodeDe {
            node,
            path: join(self.path, key),
        })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use serde::Deserialize;

    use super::*;
    use crate::yaml::parse_stream;

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields, rename_all = "camelCase")]
    struct Outer {
        inner: Inner,
        #[serde(default)]
        labels: BTreeMap<String, String>,
        #[serde(default)]
        list: Vec<i64>,
        mode: Option<Mode>,
    }

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Inner {
        weight: i64,
        on: Option<bool>,
    }

    #[derive(Debug, Deserialize)]
    #[serde(rename_all = "kebab-case")]
    enum Mode {
        WeightedFair,
        Static,
    }

    fn parse(text: &str) -> Result<Outer, String> {
        let node = parse_stream(text).unwrap().remove(0);
        from_node::<Outer>(&node, "spec")
            .map_err(|e| e.into_policy_error(&Arc::from("f.yaml")).to_string())
    }

    #[test]
    fn values_deserialise() {
        let o = parse(
            "inner: {weight: 3, on: true}\nlabels: {v: 2, gpu: true}\nlist: [1, 2]\nmode: static\n",
        )
        .unwrap();
        assert_eq!(o.inner.weight, 3);
        assert_eq!(o.inner.on, Some(true));
        assert_eq!(o.list, [1, 2]);
        assert_eq!(o.labels["v"], "2");
        assert_eq!(o.labels["gpu"], "true");
        assert!(matches!(o.mode, Some(Mode::Static)));
    }

    #[test]
    fn errors_are_positioned_and_worded() {
        assert_eq!(
            parse("inner:\n  wieght: 3\n").unwrap_err(),
            "f.yaml:2:3: unknown field `wieght` in spec.inner: did you mean `weight`? the fields here are `weight` or `on`"
        );
        assert_eq!(
            parse("inner:\n  on: true\n").unwrap_err(),
            "f.yaml:2:3: missing field `weight` in spec.inner: add `weight:`"
        );
        assert_eq!(
            parse("inner:\n  weight: high\n").unwrap_err(),
            "f.yaml:2:11: spec.inner.weight must be a whole number, found the string `high`"
        );
        assert_eq!(
            parse("inner: {weight: 1, on: yes}\n").unwrap_err(),
            "f.yaml:1:24: spec.inner.on must be `true` or `false`, found the string `yes`"
        );
        assert_eq!(
            parse("inner: {weight: 1}\nmode: weighted_fair\n").unwrap_err(),
            "f.yaml:2:7: spec.mode cannot be `weighted_fair`: did you mean `weighted-fair`? write `weighted-fair` or `static`"
        );
        assert_eq!(
            parse("inner: {weight: 1}\nlist: [1, x]\n").unwrap_err(),
            "f.yaml:2:11: spec.list[1] must be a whole number, found the string `x`"
        );
        for written in ["1e3", "1000.0"] {
            assert_eq!(
                parse(&format!("inner: {{weight: {written}}}\n")).unwrap_err(),
                "f.yaml:1:17: spec.inner.weight must be a whole number, found 1000 written with a decimal point or an exponent (write whole numbers with digits only)"
            );
        }
        assert_eq!(
            parse("inner: {weight: 18446744073709551615}\n").unwrap_err(),
            "f.yaml:1:17: spec.inner.weight must be a whole number, found a number too large to read exactly"
        );
        assert_eq!(
            parse("inner: {weight: 1}\nlabels: {a: }\n").unwrap_err(),
            "f.yaml:2:10: spec.labels.a must be a string (quote it if it looks like a number), found nothing (an empty value)"
        );
    }
}
