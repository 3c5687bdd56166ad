//! Store URLs, the object stores built from them, and the errors of stores.

use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::local::LocalFileSystem;
use object_store::path::Path;
use object_store::{BackoffConfig, ClientOptions, ObjectStore, RetryConfig};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// A parsed store URL.
///
/// * `file:///abs/path/` — a directory. Absolute, ends with `/`, written
///   literally: no percent-encoding, query or fragment, and no empty, `.`
///   or `..` components. Created if missing.
/// * `s3://bucket/prefix/?endpoint=http://127.0.0.1:9000&region=us-east-1&path_style=true`
///   — credentials from the standard AWS environment variables. The prefix
///   may be empty (`s3://bucket/`); when present it ends with `/`. Query
///   keys, all optional: `endpoint` (an `http://` or `https://` URL; plain
///   HTTP is allowed only when the endpoint asks for it), `region` (else
///   `AWS_REGION`/`AWS_DEFAULT_REGION`, else `us-east-1`) and `path_style`
///   (`true` or `false`; defaults to `true` with an `endpoint`, the usual
///   need of S3-compatible servers, and to `false` without one). Any other
///   key is refused, so a misspelt setting is an error, not a surprise.
///
/// Two URLs are the same store only if they are written the same way.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreUrl {
    raw: String,
    kind: Kind,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Kind {
    File {
        dir: PathBuf,
    },
    S3 {
        bucket: String,
        prefix: String,
        endpoint: Option<String>,
        region: Option<String>,
        path_style: Option<bool>,
    },
}

/// Bucket names per S3's rules: 3 to 63 bytes.
const BUCKET_LEN_MIN: usize = 3;
const BUCKET_LEN_MAX: usize = 63;

impl StoreUrl {
    /// The store as metrics name it: scheme and bucket of an S3 store
    /// (without prefix or query), the directory of a file store.
    pub fn label(&self) -> String {
        match &self.kind {
            Kind::File { dir } => format!("file://{}", dir.display()),
            Kind::S3 { bucket, .. } => format!("s3://{bucket}/"),
        }
    }

    pub fn parse(url: &str) -> Result<StoreUrl, StoreError> {
        let kind = if let Some(path) = url.strip_prefix("file://") {
            file_kind(url, path)?
        } else if let Some(rest) = url.strip_prefix("s3://") {
            s3_kind(url, rest)?
        } else {
            return Err(bad_url(
                url,
                "stores are file:///abs/dir/ or s3://bucket/prefix/",
            ));
        };
        Ok(StoreUrl {
            raw: url.to_string(),
            kind,
        })
    }

    /// The URL as written.
    pub fn as_str(&self) -> &str {
        &self.raw
    }

    /// The key prefix every object of this store starts with: the S3
    /// prefix (`""` or ending with `/`); `""` for a file store, whose
    /// directory is the root of its keys.
    pub fn prefix(&self) -> &str {
        match &self.kind {
            Kind::File { .. } => "",
            Kind::S3 { prefix, .. } => prefix,
        }
    }

    /// The directory of a `file://` store.
    pub fn file_dir(&self) -> Option<&std::path::Path> {
        match &self.kind {
            Kind::File { dir } => Some(dir),
            Kind::S3 { .. } => None,
        }
    }

    /// The bucket of an `s3://` store.
    pub fn bucket(&self) -> Option<&str> {
        match &self.kind {
            Kind::File { .. } => None,
            Kind::S3 { bucket, .. } => Some(bucket),
        }
    }
}

/// A store URL that is not one, and why.
fn bad_url(url: &str, why: &str) -> StoreError {
    StoreError::BadUrl {
        url: url.to_string(),
        why: why.to_string(),
    }
}

/// `file://` + `path`: an absolute directory, written literally.
fn file_kind(url: &str, path: &str) -> Result<Kind, StoreError> {
    let bad = |why: &str| bad_url(url, why);
    if !path.starts_with('/') {
        return Err(bad(
            "a file store must be an absolute path: file:///abs/dir/",
        ));
    }
    if !path.ends_with('/') {
        return Err(bad("a store URL must end with '/'"));
    }
    if path.contains(['?', '#', '%']) {
        return Err(bad(
            "a file store is written literally: no query, fragment or percent-encoding",
        ));
    }
    if path != "/" {
        check_clean(&path[1..path.len() - 1]).map_err(bad)?;
    }
    Ok(Kind::File {
        dir: PathBuf::from(path),
    })
}

/// `s3://` + `rest`: a bucket, a prefix ending with `/` (or none) and
/// settings in the query.
fn s3_kind(url: &str, rest: &str) -> Result<Kind, StoreError> {
    let bad = |why: &str| bad_url(url, why);
    let (location, query) = match rest.split_once('?') {
        Some((location, query)) => (location, Some(query)),
        None => (rest, None),
    };
    if location.contains('#') {
        return Err(bad("a store URL has no fragment"));
    }
    let Some((bucket, prefix)) = location.split_once('/') else {
        return Err(bad("a store URL must end with '/': s3://bucket/prefix/"));
    };
    let bucket_ok = (BUCKET_LEN_MIN..=BUCKET_LEN_MAX).contains(&bucket.len())
        && bucket
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-');
    if !bucket_ok {
        return Err(bad(
            "bucket names are 3 to 63 lowercase letters, digits, '.' and '-'",
        ));
    }
    if !prefix.is_empty() {
        if !prefix.ends_with('/') {
            return Err(bad("a store URL must end with '/': s3://bucket/prefix/"));
        }
        check_clean(&prefix[..prefix.len() - 1]).map_err(bad)?;
        if prefix.bytes().any(|b| b.is_ascii_control()) {
            return Err(bad("a prefix holds no control characters"));
        }
    }
    let (endpoint, region, path_style) = s3_settings(url, query)?;
    Ok(Kind::S3 {
        bucket: bucket.to_string(),
        prefix: prefix.to_string(),
        endpoint,
        region,
        path_style,
    })
}

/// An S3 store's `endpoint`, `region` and `path_style`.
type S3Settings = (Option<String>, Option<String>, Option<bool>);

/// An S3 store's settings, each given at most once.
fn s3_settings(url: &str, query: Option<&str>) -> Result<S3Settings, StoreError> {
    let bad = |why: &str| bad_url(url, why);
    let (mut endpoint, mut region, mut path_style) = (None, None, None);
    for (key, value) in url::form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
        let slot_taken = match key.as_ref() {
            "endpoint" => {
                let ok = url::Url::parse(&value)
                    .map(|u| matches!(u.scheme(), "http" | "https") && u.host().is_some())
                    .unwrap_or(false);
                if !ok {
                    return Err(bad("endpoint must be an http:// or https:// URL"));
                }
                endpoint.replace(value.into_owned()).is_some()
            }
            "region" => {
                if value.is_empty() {
                    return Err(bad("region must not be empty"));
                }
                region.replace(value.into_owned()).is_some()
            }
            "path_style" => {
                let v = match value.as_ref() {
                    "true" => true,
                    "false" => false,
                    _ => return Err(bad("path_style must be true or false")),
                };
                path_style.replace(v).is_some()
            }
            _ => {
                return Err(bad(
                    "unknown setting; an s3 store takes endpoint, region and path_style",
                ))
            }
        };
        if slot_taken {
            return Err(bad("a setting is given twice"));
        }
    }
    Ok((endpoint, region, path_style))
}

impl std::fmt::Display for StoreUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.raw)
    }
}

/// `path` is `a/b/c` (no leading or trailing `/`): at least one
/// component, each non-empty and neither `.` nor `..`.
fn check_clean(path: &str) -> Result<(), &'static str> {
    if path
        .split('/')
        .any(|part| part.is_empty() || part == "." || part == "..")
    {
        return Err("a store path has no empty, '.' or '..' components");
    }
    Ok(())
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// The store did not answer, or answered with a server error.
    #[error("store {store}: {message}")]
    Unavailable { store: String, message: String },
    /// The store URL is malformed or names an unsupported store.
    #[error("store URL {url:?}: {why}")]
    BadUrl { url: String, why: String },
    /// The store refused our credentials. Credentials are read once, when
    /// the store is first used, so this needs an operator.
    #[error("store {store}: access denied: {message}")]
    Denied { store: String, message: String },
    /// No object at the key.
    #[error("store {store}: no object {key}")]
    NotFound { store: String, key: String },
    /// An object's bytes do not match its name (length, SHA-1 or
    /// compression): it is never served.
    #[error("store {store}: object {key} is corrupt: {why}")]
    Corrupt {
        store: String,
        key: String,
        why: String,
    },
    /// What an upload wrote did not read back as written; the object was
    /// removed (if it could be) and the upload may be tried again.
    #[error("store {store}: upload of {key} did not verify: {why}")]
    VerifyFailed {
        store: String,
        key: String,
        why: String,
    },
    /// The local fragment file does not hold the bytes its job names.
    #[error("local fragment {path:?} is corrupt: {why}")]
    LocalCorrupt { path: PathBuf, why: String },
    /// The local fragment file could not be read. `errno` is the OS
    /// error, when there was one: a disk that failed for good
    /// (`rotary_proto::disk`) is not retried.
    #[error("local fragment {path:?}: {kind}: {message}")]
    LocalIo {
        path: PathBuf,
        kind: std::io::ErrorKind,
        errno: Option<i32>,
        message: String,
    },
    /// A journal name that cannot name objects.
    #[error("journal {journal:?}: {why}")]
    BadJournal { journal: String, why: String },
    /// A history read asked for an offset outside the fragment.
    #[error("offset {from} is outside fragment [{begin}, {end})")]
    BadOffset { from: u64, begin: u64, end: u64 },
    /// The uploader pool has shut down.
    #[error("the uploader has stopped")]
    Stopped,
}

impl StoreError {
    /// A failed read of the local fragment file at `path`, keeping its OS
    /// error.
    pub fn local_io(path: &std::path::Path, e: &std::io::Error) -> StoreError {
        StoreError::LocalIo {
            path: path.to_path_buf(),
            kind: e.kind(),
            errno: e.raw_os_error(),
            message: e.to_string(),
        }
    }

    /// Whether retrying later may succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            StoreError::Unavailable { .. } | StoreError::VerifyFailed { .. } => true,
            StoreError::LocalIo { kind, errno, .. } => {
                !matches!(
                    kind,
                    std::io::ErrorKind::NotFound | std::io::ErrorKind::PermissionDenied
                ) && errno.is_none_or(|e| !rotary_proto::disk::errno_is_final(e))
            }
            StoreError::BadUrl { .. }
            | StoreError::Denied { .. }
            | StoreError::NotFound { .. }
            | StoreError::Corrupt { .. }
            | StoreError::LocalCorrupt { .. }
            | StoreError::BadJournal { .. }
            | StoreError::BadOffset { .. }
            | StoreError::Stopped => false,
        }
    }

    /// Maps an `object_store` error met at `key` of `store`.
    pub(crate) fn from_object_store(store: &str, key: &str, e: object_store::Error) -> StoreError {
        use object_store::Error as E;
        match e {
            E::NotFound { .. } => StoreError::NotFound {
                store: store.to_string(),
                key: key.to_string(),
            },
            E::PermissionDenied { .. } | E::Unauthenticated { .. } => StoreError::Denied {
                store: store.to_string(),
                message: e.to_string(),
            },
            E::InvalidPath { .. } => StoreError::BadJournal {
                journal: key.to_string(),
                why: e.to_string(),
            },
            // The pool's runtime shut down under a request it had handed
            // to a blocking task (a file store's reads and writes).
            E::JoinError { source } if source.is_cancelled() => StoreError::Stopped,
            e => StoreError::Unavailable {
                store: store.to_string(),
                message: format!("{key}: {e}"),
            },
        }
    }
}

/// One request to a store, start to end (an upload PUT of a few hundred
/// MiB included).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(300);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// `object_store`'s own retries of one request. Kept short: uploads retry
/// whole jobs themselves, and the shard re-queues after that.
const REQUEST_RETRIES_MAX: usize = 2;
const REQUEST_RETRY_TIMEOUT: Duration = Duration::from_secs(20);
const REQUEST_BACKOFF_INIT: Duration = Duration::from_millis(100);
const REQUEST_BACKOFF_MAX: Duration = Duration::from_secs(1);
const DEFAULT_REGION: &str = "us-east-1";
/// `object_store`'s default address of the instance metadata service.
const METADATA_ENDPOINT: &str = "http://169.254.169.254";

pub(crate) enum Backend {
    File(Arc<LocalFileSystem>),
    S3(Arc<AmazonS3>),
}

/// A built store: the URL and its `object_store`.
pub(crate) struct Store {
    pub(crate) url: StoreUrl,
    pub(crate) backend: Backend,
    /// For S3 with no credentials configured: the metadata service's
    /// address, to recognize its errors by.
    metadata: Option<String>,
}

impl Store {
    /// Builds the object store of `url`. For a file store, creates its
    /// directory. Blocking (a `mkdir` at most), and runs no requests.
    pub(crate) fn open(url: &StoreUrl) -> Result<Store, StoreError> {
        let unavailable = |message: String| StoreError::Unavailable {
            store: url.raw.clone(),
            message,
        };
        let (backend, metadata) = match &url.kind {
            Kind::File { dir } => {
                std::fs::create_dir_all(dir)
                    .map_err(|e| unavailable(format!("cannot create {}: {e}", dir.display())))?;
                let fs = LocalFileSystem::new_with_prefix(dir)
                    .map_err(|e| unavailable(e.to_string()))?
                    // A store may hold the only copy of a fragment once the
                    // local one is gone: make writes durable.
                    .with_fsync(true);
                (Backend::File(Arc::new(fs)), None)
            }
            Kind::S3 {
                bucket,
                endpoint,
                region,
                path_style,
                ..
            } => {
                let mut b = AmazonS3Builder::from_env().with_bucket_name(bucket);
                if let Some(region) = region {
                    b = b.with_region(region);
                } else if std::env::var_os("AWS_REGION").is_none()
                    && std::env::var_os("AWS_DEFAULT_REGION").is_none()
                {
                    b = b.with_region(DEFAULT_REGION);
                }
                let path_style = path_style.unwrap_or(endpoint.is_some());
                let mut client = ClientOptions::new()
                    .with_timeout(REQUEST_TIMEOUT)
                    .with_connect_timeout(CONNECT_TIMEOUT);
                if let Some(endpoint) = endpoint {
                    let endpoint = if path_style {
                        endpoint.clone()
                    } else {
                        virtual_hosted(endpoint, bucket).map_err(|why| StoreError::BadUrl {
                            url: url.raw.clone(),
                            why,
                        })?
                    };
                    client = client.with_allow_http(endpoint.starts_with("http://"));
                    b = b.with_endpoint(endpoint);
                }
                let b = b
                    .with_virtual_hosted_style_request(!path_style)
                    .with_client_options(client)
                    .with_retry(RetryConfig {
                        backoff: BackoffConfig {
                            init_backoff: REQUEST_BACKOFF_INIT,
                            max_backoff: REQUEST_BACKOFF_MAX,
                            base: 2.0,
                        },
                        max_retries: REQUEST_RETRIES_MAX,
                        retry_timeout: REQUEST_RETRY_TIMEOUT,
                    });
                let metadata = credentials_from_metadata(&b);
                let s3 = b.build().map_err(|e| StoreError::BadUrl {
                    url: url.raw.clone(),
                    why: e.to_string(),
                })?;
                (Backend::S3(Arc::new(s3)), metadata)
            }
        };
        Ok(Store {
            url: url.clone(),
            backend,
            metadata,
        })
    }

    pub(crate) fn object(&self) -> &dyn ObjectStore {
        match &self.backend {
            Backend::File(fs) => fs.as_ref(),
            Backend::S3(s3) => s3.as_ref(),
        }
    }

    /// The object path of `key` (relative to the store's prefix).
    pub(crate) fn path(&self, key: &str) -> Result<Path, StoreError> {
        let full = format!("{}{}", self.url.prefix(), key);
        Path::parse(&full).map_err(|e| StoreError::BadJournal {
            journal: key.to_string(),
            why: e.to_string(),
        })
    }

    /// The key (relative to the store's prefix) of an object path.
    pub(crate) fn key_of<'a>(&self, path: &'a Path) -> Option<&'a str> {
        path.as_ref().strip_prefix(self.url.prefix())
    }

    pub(crate) fn err(&self, key: &str, e: object_store::Error) -> StoreError {
        let e = StoreError::from_object_store(&self.url.raw, key, e);
        // Off a cloud instance, a process with no credentials in its
        // environment meets this as an error about the metadata service's
        // address, which names neither the cause nor the fix.
        let Some(at) = self.metadata.as_deref() else {
            return e;
        };
        let hint = |message: String| {
            format!(
                "no credentials: the environment names none (such as AWS_ACCESS_KEY_ID \
                 and AWS_SECRET_ACCESS_KEY), and the instance metadata service gave \
                 none: {message}"
            )
        };
        match e {
            StoreError::Unavailable { store, message } if message.contains(at) => {
                StoreError::Unavailable {
                    store,
                    message: hint(message),
                }
            }
            StoreError::Denied { store, message } if message.contains(at) => StoreError::Denied {
                store,
                message: hint(message),
            },
            e => e,
        }
    }
}

/// The address of the instance metadata service, if that is where an S3
/// client built from `b` gets its credentials: when its configuration (the
/// broker's `AWS_*` environment) names no other source and signs requests.
fn credentials_from_metadata(b: &AmazonS3Builder) -> Option<String> {
    use object_store::aws::AmazonS3ConfigKey as K;
    let set = |k: K| b.get_config_value(&k).is_some();
    let named = set(K::AccessKeyId)
        || set(K::SecretAccessKey)
        || (set(K::WebIdentityTokenFile) && set(K::RoleArn))
        || set(K::ContainerCredentialsRelativeUri)
        || (set(K::ContainerCredentialsFullUri) && set(K::ContainerAuthorizationTokenFile));
    let unsigned = b
        .get_config_value(&K::SkipSignature)
        .is_some_and(|v| v.eq_ignore_ascii_case("true"));
    if named || unsigned {
        return None;
    }
    let at = b
        .get_config_value(&K::MetadataEndpoint)
        .unwrap_or_else(|| METADATA_ENDPOINT.to_string());
    Some(at.trim_end_matches('/').to_string())
}

/// `http://host:port` → `http://bucket.host:port`, for virtual-hosted
/// requests to a custom endpoint (`object_store` expects the bucket in it).
fn virtual_hosted(endpoint: &str, bucket: &str) -> Result<String, String> {
    let mut u = url::Url::parse(endpoint).map_err(|e| format!("endpoint: {e}"))?;
    let host = u
        .host_str()
        .ok_or_else(|| "endpoint has no host".to_string())?
        .to_string();
    u.set_host(Some(&format!("{bucket}.{host}")))
        .map_err(|e| format!("endpoint: {e}"))?;
    Ok(u.as_str().trim_end_matches('/').to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_urls() {
        let u = StoreUrl::parse("file:///var/lib/rotary/store/").unwrap();
        assert_eq!(
            u.file_dir(),
            Some(std::path::Path::new("/var/lib/rotary/store/"))
        );
        assert_eq!(u.prefix(), "");
        assert_eq!(u.as_str(), "file:///var/lib/rotary/store/");
        assert!(StoreUrl::parse("file:///").is_ok());
        for bad in [
            "file://relative/dir/",
            "file:///no/trailing/slash",
            "file:///a//b/",
            "file:///a/../b/",
            "file:///a/./b/",
            "file:////",
            "file:///a/b/?x=1",
            "file:///a%20b/",
            "files:///a/",
            "",
        ] {
            let e = StoreUrl::parse(bad).unwrap_err();
            assert!(matches!(e, StoreError::BadUrl { .. }), "{bad}: {e}");
            assert!(!e.is_retryable());
        }
    }

    #[test]
    fn s3_urls() {
        let u = StoreUrl::parse("s3://bucket/").unwrap();
        assert_eq!((u.bucket(), u.prefix()), (Some("bucket"), ""));
        let u = StoreUrl::parse(
            "s3://my-bucket/a/b/?endpoint=http://127.0.0.1:9000&region=eu-west-1&path_style=true",
        )
        .unwrap();
        assert_eq!(u.prefix(), "a/b/");
        assert_eq!(
            u.kind,
            Kind::S3 {
                bucket: "my-bucket".into(),
                prefix: "a/b/".into(),
                endpoint: Some("http://127.0.0.1:9000".into()),
                region: Some("eu-west-1".into()),
                path_style: Some(true),
            }
        );
        // Percent-encoded values decode.
        let u = StoreUrl::parse("s3://bucket/p/?endpoint=http%3A%2F%2Flocalhost%3A1").unwrap();
        assert!(
            matches!(u.kind, Kind::S3 { endpoint: Some(ref e), .. } if e == "http://localhost:1")
        );
        for bad in [
            "s3://bucket",
            "s3://bucket/prefix",
            "s3://Bucket/",
            "s3://b/",
            "s3://bucket//",
            "s3://bucket/a/../",
            "s3://bucket/?endpoint=ftp://x",
            "s3://bucket/?endpoint=nonsense",
            "s3://bucket/?path_style=yes",
            "s3://bucket/?region=",
            "s3://bucket/?regoin=us-east-1",
            "s3://bucket/?region=a&region=b",
            "s3://bucket/#frag",
        ] {
            assert!(
                matches!(StoreUrl::parse(bad), Err(StoreError::BadUrl { .. })),
                "{bad}"
            );
        }
    }

    #[test]
    fn virtual_hosted_endpoints() {
        assert_eq!(
            virtual_hosted("http://127.0.0.1.nip.io:9000", "bkt").unwrap(),
            "http://bkt.127.0.0.1.nip.io:9000"
        );
        assert_eq!(
            virtual_hosted("https://s3.example.com/", "bkt").unwrap(),
            "https://bkt.s3.example.com"
        );
    }

    /// A request cut off by the pool's shutdown is `Stopped`, not a store
    /// that is unavailable; any other failed join is the store's.
    #[test]
    fn a_request_cancelled_by_the_shutdown_is_stopped() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let cancelled = rt.block_on(async {
            let task = tokio::spawn(std::future::pending::<()>());
            task.abort();
            task.await.unwrap_err()
        });
        let panicked = rt.block_on(async {
            tokio::spawn(async { panic!("in a task") })
                .await
                .unwrap_err()
        });
        let map = |source| {
            StoreError::from_object_store("s", "k", object_store::Error::JoinError { source })
        };
        assert!(matches!(map(cancelled), StoreError::Stopped));
        assert!(matches!(map(panicked), StoreError::Unavailable { .. }));
    }

    #[test]
    fn retryability() {
        let unavailable = StoreError::Unavailable {
            store: "s3://b/".into(),
            message: "connection refused".into(),
        };
        assert!(unavailable.is_retryable());
        let corrupt = StoreError::LocalCorrupt {
            path: "/x.raw".into(),
            why: "sha1".into(),
        };
        assert!(!corrupt.is_retryable());
        let io = |kind| StoreError::LocalIo {
            path: "/x.raw".into(),
            kind,
            errno: None,
            message: String::new(),
        };
        assert!(!io(std::io::ErrorKind::NotFound).is_retryable());
        assert!(io(std::io::ErrorKind::Interrupted).is_retryable());
        // A disk that failed under the fragment does not heal: its read is
        // not retried; one that was interrupted or short of memory may pass.
        let os = |errno| {
            StoreError::local_io(
                std::path::Path::new("/x.raw"),
                &std::io::Error::from_raw_os_error(errno),
            )
        };
        for errno in [
            libc::EIO,
            libc::ENXIO,
            libc::ENODEV,
            libc::EROFS,
            libc::EUCLEAN,
        ] {
            let e = os(errno);
            assert!(!e.is_retryable(), "{e}");
        }
        for errno in [libc::EINTR, libc::ENOMEM, libc::EAGAIN, libc::EMFILE] {
            let e = os(errno);
            assert!(e.is_retryable(), "{e}");
        }
        assert!(!StoreError::Stopped.is_retryable());
    }
}
