//! Forgejo's webhook deliveries as a `forgejo` (or `gitea`) hook sends them: the body is the
//! payload JSON as stored, POSTed as `application/json`, with the headers of
//! `services/webhook/shared/payloader.go` `AddDefaultHeaders` (v15.0.3): the delivery's UUID
//! and its event under the `X-Forgejo-`, `X-Gitea-`, `X-Gogs-` and `X-GitHub-` names, and the
//! hex HMAC-SHA256 of the body under the hook's secret as `X-Forgejo-Signature` (and the other
//! names; empty when the hook has no secret). `X-Hub-Signature`, the SHA-1 one, is left out.
//! The push that creates a run's jobs is the delivery the shells send when a job is added
//! (`services/webhook/notifier.go` `PushCommits`). SHA-256 and HMAC are written out here (FIPS
//! 180-4, RFC 2104), std only, so that the product's verification (ring) is checked against a
//! signer of its own.

/// SHA-256 of `data` (FIPS 180-4).
pub fn sha256(data: &[u8]) -> [u8; 32] {
    const K: [u32; 64] = [
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
        0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
        0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
        0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
        0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
        0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
        0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
        0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
        0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
        0xc67178f2,
    ];
    let mut h: [u32; 8] = [
        0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab,
        0x5be0cd19,
    ];
    let mut msg = data.to_vec();
    msg.push(0x80);
    while msg.len() % 64 != 56 {
        msg.push(0);
    }
    msg.extend_from_slice(&((data.len() as u64) * 8).to_be_bytes());
    for block in msg.chunks(64) {
        let mut w = [0u32; 64];
        for (i, word) in block.chunks(4).enumerate() {
            w[i] = u32::from_be_bytes([word[0], word[1], word[2], word[3]]);
        }
        for i in 16..64 {
            let s0 = w[i - 15].rotate_right(7) ^ w[i - 15].rotate_right(18) ^ (w[i - 15] >> 3);
            let s1 = w[i - 2].rotate_right(17) ^ w[i - 2].rotate_right(19) ^ (w[i - 2] >> 10);
            w[i] = w[i - 16]
                .wrapping_add(s0)
                .wrapping_add(w[i - 7])
                .wrapping_add(s1);
        }
        let mut v = h;
        for i in 0..64 {
            let s1 = v[4].rotate_right(6) ^ v[4].rotate_right(11) ^ v[4].rotate_right(25);
            let ch = (v[4] & v[5]) ^ (!v[4] & v[6]);
            let t1 = v[7]
                .wrapping_add(s1)
                .wrapping_add(ch)
                .wrapping_add(K[i])
                .wrapping_add(w[i]);
            let s0 = v[0].rotate_right(2) ^ v[0].rotate_right(13) ^ v[0].rotate_right(22);
            let maj = (v[0] & v[1]) ^ (v[0] & v[2]) ^ (v[1] & v[2]);
            let t2 = s0.wrapping_add(maj);
            v = [
                t1.wrapping_add(t2),
                v[0],
                v[1],
                v[2],
                v[3].wrapping_add(t1),
                v[4],
                v[5],
                v[6],
            ];
        }
        for (a, b) in h.iter_mut().zip(v) {
            *a = a.wrapping_add(b);
        }
    }
    let mut out = [0u8; 32];
    for (i, word) in h.iter().enumerate() {
        out[4 * i..4 * i + 4].copy_from_slice(&word.to_be_bytes());
    }
    out
}

/// HMAC-SHA256 (RFC 2104), Go's `hmac.New(sha256.New, secret)`.
pub fn hmac_sha256(key: &[u8], data: &[u8]) -> [u8; 32] {
    let mut k = [0u8; 64];
    if key.len() > 64 {
        k[..32].copy_from_slice(&sha256(key));
    } else {
        k[..key.len()].copy_from_slice(key);
    }
    let pad = |byte: u8| k.iter().map(|b| b ^ byte).collect::<Vec<u8>>();
    let mut inner = pad(0x36);
    inner.extend_from_slice(data);
    let mut outer = pad(0x5c);
    outer.extend_from_slice(&sha256(&inner));
    sha256(&outer)
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// One delivery: its headers (besides `Content-Type: application/json` and the length) and body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Delivery {
    pub uuid: String,
    pub headers: Vec<(&'static str, String)>,
    pub body: String,
}

/// The delivery of `payload` for an event of type `event_type` (`push`, `pull_request_sync`, …),
/// as `AddDefaultHeaders` makes it. `event` is what `HookEventType.Event()` gives (`push`;
/// `pull_request` for the pull request types).
pub fn delivery(
    secret: &str,
    uuid: &str,
    event: &str,
    event_type: &str,
    payload: &str,
) -> Delivery {
    let signature = if secret.is_empty() {
        String::new()
    } else {
        hex(&hmac_sha256(secret.as_bytes(), payload.as_bytes()))
    };
    const NAMES: [[&str; 4]; 3] = [
        [
            "X-Forgejo-Delivery",
            "X-Forgejo-Event",
            "X-Forgejo-Event-Type",
            "X-Forgejo-Signature",
        ],
        [
            "X-Gitea-Delivery",
            "X-Gitea-Event",
            "X-Gitea-Event-Type",
            "X-Gitea-Signature",
        ],
        [
            "X-Gogs-Delivery",
            "X-Gogs-Event",
            "X-Gogs-Event-Type",
            "X-Gogs-Signature",
        ],
    ];
    let mut headers = Vec::new();
    for [d, e, t, s] in NAMES {
        headers.push((d, uuid.to_string()));
        headers.push((e, event.to_string()));
        headers.push((t, event_type.to_string()));
        headers.push((s, signature.clone()));
    }
    headers.push(("X-Hub-Signature-256", format!("sha256={signature}")));
    headers.push(("X-GitHub-Delivery", uuid.to_string()));
    headers.push(("X-GitHub-Event", event.to_string()));
    headers.push(("X-GitHub-Event-Type", event_type.to_string()));
    Delivery {
        uuid: uuid.to_string(),
        headers,
        body: payload.to_string(),
    }
}

/// The payload of a push to `repo_id`'s default branch (`api.PushPayload`, the fields a receiver
/// might read), as json.Marshal writes it: what precedes a run's jobs.
pub fn push_payload(repo_id: i64, owner_id: i64, after: &str) -> String {
    format!(
        r#"{{"ref":"refs/heads/main","before":"0000000000000000000000000000000000000000","after":"{after}","compare_url":"","commits":[],"total_commits":0,"head_commit":null,"repository":{{"id":{repo_id},"owner":{{"id":{owner_id}}},"default_branch":"main"}},"pusher":{{"id":{owner_id}}},"sender":{{"id":{owner_id}}}}}"#
    )
}

#[cfg(test)]
mod tests {
    use crate::webhook::*;

    #[test]
    fn sha256_and_hmac_match_the_standards_vectors() {
        assert_eq!(
            hex(&sha256(b"abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(
            hex(&sha256(b"")),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        let long = b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
        assert_eq!(
            hex(&sha256(long)),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"
        );
        // RFC 4231 test cases 1, 2 and 6 (a key longer than a block).
        assert_eq!(
            hex(&hmac_sha256(&[0x0b; 20], b"Hi There")),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"
        );
        assert_eq!(
            hex(&hmac_sha256(b"Jefe", b"what do ya want for nothing?")),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        assert_eq!(
            hex(&hmac_sha256(
                &[0xaa; 131],
                b"Test Using Larger Than Block-Size Key - Hash Key First"
            )),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"
        );
    }

    #[test]
    fn a_delivery_carries_forgejos_headers_and_an_unsigned_one_an_empty_signature() {
        let d = delivery("s", "u-1", "push", "push", "{}");
        let get = |n: &str| {
            d.headers
                .iter()
                .find(|(k, _)| *k == n)
                .map(|(_, v)| v.as_str())
        };
        assert_eq!(get("X-Forgejo-Delivery"), Some("u-1"));
        assert_eq!(get("X-Forgejo-Event-Type"), Some("push"));
        assert_eq!(
            get("X-Forgejo-Signature"),
            Some(hex(&hmac_sha256(b"s", b"{}")).as_str())
        );
        assert_eq!(get("X-Gitea-Signature"), get("X-Forgejo-Signature"));
        let unsigned = delivery("", "u-2", "push", "push", "{}");
        assert!(
            unsigned
                .headers
                .contains(&("X-Forgejo-Signature", String::new()))
        );
    }
}
