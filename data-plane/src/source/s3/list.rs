//! Listing a bucket prefix with ListObjectsV2, keys as the store sent them.
//!
//! object_store's listing parses every key of a page into its `Path` and
//! fails the whole page (and so the dataset) on one key it cannot represent
//! (`a//b`, `a/../b`, a control character), and it drops the `/` that marks
//! a "folder" object (`cats/`, what a console's "Create folder" makes), so
//! such a marker looked like a sample that cannot be read. Here each key is
//! judged alone: markers and unservable keys are skipped, the others
//! listed. Requests are signed with object_store's SigV4 signer and sent
//! through the source's own HTTP client.

use std::time::Duration;

use http::{Method, Request, StatusCode};
use object_store::aws::{AwsAuthorizer, AwsCredentialProvider};
use object_store::client::{HttpClient, HttpErrorKind, HttpRequestBody};
use serde::Deserialize;

use crate::pace::jittered;

/// Keys per page (the most S3 returns).
const PAGE_KEYS: u32 = 1000;
/// Tries of one page request when the store refuses or resets it, and the
/// wait before the second (doubled before each next one, up to
/// [`MAX_BACKOFF`]).
const TRIES: u32 = 4;
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(2);
/// How long a page is tried again while the store answers 503 SlowDown,
/// 429 or another 5xx (it answers, so it is there: a spell of throttling
/// must not fail the whole listing).
pub const BUSY_PATIENCE: Duration = Duration::from_secs(30);

/// Where and how listing requests go.
pub struct Lister {
    pub http: HttpClient,
    /// The bucket's URL (`https://bucket.s3.region.amazonaws.com`, or
    /// `endpoint/bucket` path-style), no trailing `/`.
    pub bucket_url: String,
    pub region: String,
    /// `None` for unsigned requests (`--s3-anonymous`).
    pub credentials: Option<AwsCredentialProvider>,
    /// How long one page request may take.
    pub timeout: Duration,
}

/// One listed object: its key as stored, its size and what identifies its
/// version (the ETag, else the modification time).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    pub key: String,
    pub size: u64,
    pub version: Version,
}

/// What identifies a listed object's version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Version {
    /// Its ETag, as the listing quotes it.
    Tag(String),
    /// Its modification time (`2026-01-02T03:04:05.000Z`), where the store
    /// lists no ETags (some S3-compatible servers do not).
    Modified(String),
}

/// One page: the objects, the sub-prefixes (with a delimiter), and where
/// the next page starts, if there is one.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Page {
    pub objects: Vec<Listed>,
    pub prefixes: Vec<String>,
    pub next: Option<Next>,
}

/// Where the next page of a listing starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    /// ListObjectsV2's continuation token.
    Token(String),
    /// After this key: a store that answers in the older ListObjects style
    /// (truncated, with no continuation token) is asked on from its
    /// `NextMarker`, else from the page's last key or prefix.
    After(String),
}

/// Why a listing request failed.
#[derive(Debug)]
pub enum ListError {
    /// The store answered with this status (and body).
    Status(StatusCode, String),
    /// No answer: refused, reset, unresolvable, TLS.
    Transport(String),
    /// No answer in time.
    Timeout(Duration),
    /// An answer that is not an S3 listing.
    NotS3(String),
    /// No credentials to sign the request with: their provider failed.
    Credentials(String),
    /// Pages that cannot be followed to the listing's end.
    Paging(String),
}

impl std::fmt::Display for ListError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Status(status, body) => match summary(body) {
                summary if summary.is_empty() => write!(f, "the store answered {status}"),
                summary => write!(f, "the store answered {status} ({summary})"),
            },
            Self::Transport(e) => write!(f, "{e}"),
            Self::Timeout(t) => write!(f, "no answer within {t:?}"),
            Self::NotS3(e) => write!(f, "the answer is not an S3 listing ({e})"),
            Self::Credentials(e) => write!(f, "could not get S3 credentials ({e})"),
            Self::Paging(e) => write!(f, "the store's listing pages cannot be followed: {e}"),
        }
    }
}

/// An error answer's body in one line: S3's error code and message, or
/// the body's words (at most 200 characters) when it is no S3 error
/// document.
pub fn summary(body: &str) -> String {
    match (xml_field(body, "Code"), xml_field(body, "Message")) {
        (Some(code), Some(message)) => format!("{code}: {message}"),
        (Some(code), None) => code.to_owned(),
        _ => {
            let words = body.split_whitespace().collect::<Vec<_>>().join(" ");
            words.chars().take(200).collect()
        }
    }
}

/// A failed request's error with its sources (object_store's own message
/// stops at "client error (Connect)"), and what it means where its words
/// do not say: TLS spoken to a port that serves plain HTTP.
pub fn told(e: &dyn std::error::Error) -> String {
    let chain = sluice_proto::error_chain(e);
    if chain.contains("InvalidContentType") {
        format!(
            "{chain}; the endpoint does not speak TLS: use an http:// URL for a store that serves plain HTTP"
        )
    } else {
        chain
    }
}

/// Whether an answer of `status` says the store is there but busy
/// (throttling, or failing for now): it is asked again.
pub fn busy(status: StatusCode) -> bool {
    status.is_server_error() || status == StatusCode::TOO_MANY_REQUESTS
}

/// The text of the first `<name>` element of an S3 error body.
pub fn xml_field<'a>(body: &'a str, name: &str) -> Option<&'a str> {
    let start = body.find(&format!("<{name}>"))? + name.len() + 2;
    let len = body[start..].find(&format!("</{name}>"))?;
    Some(body[start..start + len].trim()).filter(|v| !v.is_empty())
}

impl Lister {
    /// Lists one page of the keys beginning with `prefix` (with `/` as the
    /// delimiter when `delimited`), from `token` on. Retries refusals and
    /// resets a few times, and 5xx/429 answers for up to `patience`, with
    /// capped, jittered backoff.
    pub async fn page(
        &self,
        prefix: &str,
        delimited: bool,
        token: Option<&Next>,
        patience: Duration,
    ) -> Result<Page, ListError> {
        let started = tokio::time::Instant::now();
        let mut backoff = FIRST_BACKOFF;
        let mut tries = 0;
        loop {
            tries += 1;
            let answer = self.request(prefix, delimited, token).await;
            let again = match &answer {
                Err(ListError::Transport(_) | ListError::Timeout(_)) => tries < TRIES,
                Err(ListError::Status(status, _)) if busy(*status) => {
                    started.elapsed() + backoff <= patience
                }
                _ => false,
            };
            if !again {
                return answer;
            }
            // Less up to a quarter: the pages of a listing a store
            // throttled together do not all come back at once.
            tokio::time::sleep(jittered(backoff, 0.25)).await;
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }

    async fn request(
        &self,
        prefix: &str,
        delimited: bool,
        token: Option<&Next>,
    ) -> Result<Page, ListError> {
        let mut query = vec![
            ("list-type", "2".to_owned()),
            ("max-keys", PAGE_KEYS.to_string()),
            ("prefix", prefix.to_owned()),
        ];
        if delimited {
            query.push(("delimiter", "/".to_owned()));
        }
        match token {
            Some(Next::Token(token)) => query.push(("continuation-token", token.clone())),
            // `start-after` for ListObjectsV2, `marker` for a store that
            // only speaks the older ListObjects.
            Some(Next::After(key)) => {
                query.push(("start-after", key.clone()));
                query.push(("marker", key.clone()));
            }
            None => {}
        }
        // SigV4 signs the query sorted by name, each part encoded as below.
        query.sort();
        let query: Vec<String> = query
            .iter()
            .map(|(k, v)| format!("{k}={}", encode(v)))
            .collect();
        let url = format!("{}/?{}", self.bucket_url, query.join("&"));
        let mut request = Request::builder()
            .method(Method::GET)
            .uri(&url)
            .body(HttpRequestBody::empty())
            .map_err(|e| ListError::Transport(format!("bad listing URL {url}: {e}")))?;
        if let Some(credentials) = &self.credentials {
            let credential = credentials
                .get_credential()
                .await
                .map_err(|e| ListError::Credentials(e.to_string()))?;
            AwsAuthorizer::new(&credential, "s3", &self.region)
                .try_authorize(&mut request, None)
                .map_err(|e| ListError::Transport(format!("cannot sign the request: {e}")))?;
        }
        let exchange = async {
            let response = self.http.execute(request).await.map_err(|e| {
                let kind = match e.kind() {
                    HttpErrorKind::Connect => "cannot connect",
                    _ => "the request failed",
                };
                ListError::Transport(format!("{kind}: {}", told(&e)))
            })?;
            let status = response.status();
            let body = response
                .into_body()
                .bytes()
                .await
                .map_err(|e| ListError::Transport(format!("the answer broke off: {e}")))?;
            Ok::<_, ListError>((status, body))
        };
        let (status, body) = tokio::time::timeout(self.timeout, exchange)
            .await
            .map_err(|_| ListError::Timeout(self.timeout))??;
        let text = String::from_utf8_lossy(&body);
        if !status.is_success() {
            return Err(ListError::Status(status, text.chars().take(512).collect()));
        }
        parse(&text)
    }
}

/// Parses a ListObjectsV2 answer, decoding keys and prefixes when the store
/// says it URL-encoded them. (They are not asked for encoded: some
/// compatible stores echo `encoding-type=url` without encoding, and a key
/// with `+` or `%` then reads back wrong.)
pub fn parse(text: &str) -> Result<Page, ListError> {
    #[derive(Deserialize)]
    #[serde(rename_all = "PascalCase")]
    struct Answer {
        #[serde(default)]
        contents: Vec<Contents>,
        #[serde(default)]
        common_prefixes: Vec<Prefix>,
        #[serde(default)]
        next_continuation_token: Option<String>,
        #[serde(default)]
        is_truncated: Option<bool>,
        #[serde(default)]
        next_marker: Option<String>,
        #[serde(default)]
        encoding_type: Option<String>,
    }
    #[derive(Deserialize)]
    #[serde(rename_all = "PascalCase")]
    struct Contents {
        key: String,
        size: u64,
        #[serde(rename = "ETag", default)]
        e_tag: Option<String>,
        #[serde(default)]
        last_modified: Option<String>,
    }
    #[derive(Deserialize)]
    #[serde(rename_all = "PascalCase")]
    struct Prefix {
        prefix: String,
    }
    if !text.contains("<ListBucketResult") {
        let start: String = text.trim_start().chars().take(80).collect();
        return Err(ListError::NotS3(format!("it begins `{start}`")));
    }
    let answer: Answer =
        quick_xml::de::from_str(text).map_err(|e| ListError::NotS3(e.to_string()))?;
    let encoded = answer.encoding_type.as_deref() == Some("url");
    let decode = |s: String| if encoded { decode(&s) } else { s };
    let next = match (answer.is_truncated, answer.next_continuation_token) {
        (Some(false), _) => None,
        (_, Some(token)) => Some(Next::Token(token)),
        (None, None) => None,
        // Truncated with no token: an older ListObjects answer (the store
        // ignored `list-type=2`), which goes on after its last key.
        (Some(true), None) => {
            let last_key = answer.contents.last().map(|c| decode(c.key.clone()));
            let last_prefix = answer
                .common_prefixes
                .last()
                .map(|p| decode(p.prefix.clone()));
            let after = answer.next_marker.map(decode).or(last_key.max(last_prefix));
            match after {
                Some(key) => Some(Next::After(key)),
                None => {
                    return Err(ListError::Paging(
                        "a page says the listing goes on, but gives no continuation token, marker or key to go on from"
                            .into(),
                    ));
                }
            }
        }
    };
    Ok(Page {
        objects: answer
            .contents
            .into_iter()
            .map(|c| Listed {
                key: decode(c.key),
                size: c.size,
                version: match (c.e_tag, c.last_modified) {
                    (Some(tag), _) => Version::Tag(tag),
                    (None, Some(time)) => Version::Modified(time),
                    (None, None) => Version::Tag(String::new()),
                },
            })
            .collect(),
        prefixes: answer
            .common_prefixes
            .into_iter()
            .map(|p| decode(p.prefix))
            .collect(),
        next,
    })
}

/// Percent-encodes a query value as SigV4 wants it: everything but
/// `A-Z a-z 0-9 - _ . ~`.
fn encode(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for b in value.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Decodes a key S3 URL-encoded in a listing (`%XX`, and `+` for a space,
/// as AWS writes it). A malformed escape is kept as it is.
fn decode(value: &str) -> String {
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                match std::str::from_utf8(&bytes[i + 1..i + 3])
                    .ok()
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                {
                    Some(b) => {
                        out.push(b);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_answer_is_told_in_one_line() {
        let slow_down = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SlowDown</Code>\n<Message>Please reduce your request rate.</Message><RequestId>1</RequestId></Error>";
        let e = ListError::Status(StatusCode::SERVICE_UNAVAILABLE, slow_down.into());
        assert_eq!(
            e.to_string(),
            "the store answered 503 Service Unavailable (SlowDown: Please reduce your request rate.)"
        );
        let page = ListError::Status(
            StatusCode::BAD_GATEWAY,
            "<html>\n <b>Bad\tgateway</b>\n</html>\n".into(),
        );
        assert_eq!(
            page.to_string(),
            "the store answered 502 Bad Gateway (<html> <b>Bad gateway</b> </html>)"
        );
        let empty = ListError::Status(StatusCode::INTERNAL_SERVER_ERROR, String::new());
        assert_eq!(
            empty.to_string(),
            "the store answered 500 Internal Server Error"
        );
    }

    #[test]
    fn keys_are_decoded_only_when_the_store_encoded_them() {
        let encoded = r#"<?xml version="1.0" encoding="UTF-8"?>
<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Name>b</Name>
<Prefix>train%2F</Prefix><KeyCount>3</KeyCount><MaxKeys>1000</MaxKeys><EncodingType>url</EncodingType>
<IsTruncated>true</IsTruncated><NextContinuationToken>tok+en/=</NextContinuationToken>
<Contents><Key>train/cats/</Key><Size>0</Size><ETag>&quot;d41d&quot;</ETag><LastModified>2026-01-01T00:00:00.000Z</LastModified></Contents>
<Contents><Key>train/a+b%2Bc%09d%25.jpg</Key><Size>7</Size><ETag>&quot;e1&quot;</ETag></Contents>
<Contents><Key>train/no-etag</Key><Size>1</Size><LastModified>2026-01-02T00:00:00.000Z</LastModified></Contents>
<CommonPrefixes><Prefix>train/dogs%20x/</Prefix></CommonPrefixes>
</ListBucketResult>"#;
        let page = parse(encoded).unwrap();
        let keys: Vec<&str> = page.objects.iter().map(|o| o.key.as_str()).collect();
        assert_eq!(
            keys,
            ["train/cats/", "train/a b+c\td%.jpg", "train/no-etag"]
        );
        assert_eq!(page.objects[1].size, 7);
        assert_eq!(page.objects[1].version, Version::Tag("\"e1\"".into()));
        assert_eq!(
            page.objects[2].version,
            Version::Modified("2026-01-02T00:00:00.000Z".into())
        );
        assert_eq!(page.prefixes, ["train/dogs x/"]);
        assert_eq!(page.next, Some(Next::Token("tok+en/=".into())));

        let raw = "<ListBucketResult><IsTruncated>false</IsTruncated>\
                   <NextContinuationToken>stale</NextContinuationToken>\
                   <Contents><Key>a+b%41</Key><Size>1</Size></Contents></ListBucketResult>";
        let page = parse(raw).unwrap();
        assert_eq!(page.objects[0].key, "a+b%41");
        assert_eq!(page.next, None, "a last page has no next page");
    }

    #[test]
    fn an_older_listobjects_answer_goes_on_after_its_last_key() {
        let page = |inner: &str| parse(&format!("<ListBucketResult>{inner}</ListBucketResult>"));
        let truncated = "<IsTruncated>true</IsTruncated><Marker></Marker>\
                         <Contents><Key>p/a</Key><Size>1</Size></Contents>\
                         <Contents><Key>p/b</Key><Size>1</Size></Contents>";
        assert_eq!(
            page(truncated).unwrap().next,
            Some(Next::After("p/b".into()))
        );
        // Its NextMarker (sent with a delimiter) first; else the later of
        // the last key and the last prefix.
        let marked = format!("{truncated}<NextMarker>p/c/</NextMarker>");
        assert_eq!(
            page(&marked).unwrap().next,
            Some(Next::After("p/c/".into()))
        );
        let prefixed = format!("{truncated}<CommonPrefixes><Prefix>p/c/</Prefix></CommonPrefixes>");
        assert_eq!(
            page(&prefixed).unwrap().next,
            Some(Next::After("p/c/".into()))
        );
        let nothing = page("<IsTruncated>true</IsTruncated>").unwrap_err();
        assert!(matches!(nothing, ListError::Paging(_)), "{nothing}");
        // Not said truncated, no token: the end.
        assert_eq!(
            page("<Contents><Key>a</Key><Size>1</Size></Contents>")
                .unwrap()
                .next,
            None
        );
    }

    #[test]
    fn an_answer_that_is_not_a_listing_is_refused() {
        for text in [
            "<html><body>Welcome to nginx!</body></html>",
            "",
            "{\"ok\": true}",
        ] {
            assert!(matches!(parse(text), Err(ListError::NotS3(_))), "{text}");
        }
    }

    #[test]
    fn query_values_are_encoded_for_signing_and_keys_decoded_back() {
        assert_eq!(encode("a b/c+d~e_f.g-h%"), "a%20b%2Fc%2Bd~e_f.g-h%25");
        assert_eq!(encode("é"), "%C3%A9");
        assert_eq!(decode("%C3%A9%2"), "é%2");
        assert_eq!(decode("100%"), "100%");
        assert_eq!(decode("%zz"), "%zz");
    }
}
