//! Tokens signed by keys the tests make: ES256 (rcgen) and RS256 (the openssl CLI).

use std::path::Path;
use std::process::Command;

use base64::Engine;
use http::HeaderMap;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde_json::{json, Value};

use super::*;

fn b64(b: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b)
}

struct Key {
    enc: EncodingKey,
    alg: Algorithm,
    jwk: Value,
}

fn ec_key(kid: &str) -> Key {
    let kp = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
    let raw = kp.public_key_raw();
    let jwk = json!({"kty": "EC", "crv": "P-256", "kid": kid, "alg": "ES256", "x": b64(&raw[1..33]), "y": b64(&raw[33..65])});
    Key {
        enc: EncodingKey::from_ec_der(&kp.serialize_der()),
        alg: Algorithm::ES256,
        jwk,
    }
}

fn rsa_key(kid: &str) -> Key {
    let dir = std::env::temp_dir().join(format!("wp-authn-{}-{kid}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let pem = dir.join("k.pem");
    let der = dir.join("k.der");
    let run = |args: &[&str]| {
        let out = Command::new("openssl")
            .args(args)
            .output()
            .expect("openssl");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let p = |x: &Path| x.display().to_string();
    run(&["genrsa", "-out", &p(&pem), "2048"]);
    run(&[
        "rsa",
        "-in",
        &p(&pem),
        "-traditional",
        "-outform",
        "DER",
        "-out",
        &p(&der),
    ]);
    let modulus = run(&["rsa", "-in", &p(&pem), "-noout", "-modulus"]);
    let hex = modulus.trim().trim_start_matches("Modulus=");
    let n: Vec<u8> = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect();
    let enc = EncodingKey::from_rsa_der(&std::fs::read(&der).unwrap());
    let _ = std::fs::remove_dir_all(&dir);
    Key {
        enc,
        alg: Algorithm::RS256,
        jwk: json!({"kty": "RSA", "kid": kid, "alg": "RS256", "n": b64(&n), "e": "AQAB"}),
    }
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

fn token(k: &Key, kid: &str, claims: Value) -> String {
    let mut h = Header::new(k.alg);
    h.kid = Some(kid.to_string());
    jsonwebtoken::encode(&h, &claims, &k.enc).unwrap()
}

fn claims(iss: &str) -> Value {
    json!({"iss": iss, "sub": "alice", "aud": ["web", "api"], "azp": "cli", "exp": now() + 600, "scope": "read write",
           "groups": ["dev", "ops"], "org": {"team": {"name": "core"}}, "level": 3})
}

fn ra(rules: Value) -> RequestAuthentication {
    let a: RequestAuthentication = serde_json::from_value(json!({
        "name": "jwt", "namespace": "default", "targetRefs": [{"kind": "Service", "name": "echo"}], "jwtRules": rules}))
    .unwrap();
    a.validate().unwrap();
    a
}

fn jwks(keys: &[&Key]) -> String {
    json!({"keys": keys.iter().map(|k| k.jwk.clone()).collect::<Vec<_>>()}).to_string()
}

fn auth(
    a: &RequestAuthentication,
    headers: &mut HeaderMap,
    query: Option<&str>,
) -> Result<Option<RequestAuth>, Failure> {
    authenticate(
        &[a],
        &JwksStore::new(JwksSettings::default()),
        headers,
        query,
    )
}

fn bearer(t: &str) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert("authorization", format!("Bearer {t}").parse().unwrap());
    h
}

#[test]
fn rs256_and_es256_tokens_verify_and_invalid_ones_fail() {
    let (rsa, ec, other) = (rsa_key("r1"), ec_key("e1"), ec_key("e1"));
    let a = ra(
        json!([{"issuer": "https://idp.example", "jwks": jwks(&[&rsa, &ec]), "audiences": ["api"]}]),
    );
    for (k, kid) in [(&rsa, "r1"), (&ec, "e1")] {
        let mut h = bearer(&token(k, kid, claims("https://idp.example")));
        let got = auth(&a, &mut h, None).unwrap().unwrap();
        assert_eq!(got.principal, "https://idp.example/alice");
        assert!(
            h.get("authorization").is_none(),
            "the token is not forwarded by default"
        );
    }
    let bad = |h: &mut HeaderMap| auth(&a, h, None).unwrap_err();
    // Signed by another key with the same kid.
    assert_eq!(
        bad(&mut bearer(&token(
            &other,
            "e1",
            claims("https://idp.example")
        ))),
        Failure::Signature
    );
    let mut c = claims("https://idp.example");
    c["exp"] = json!(now() - 3600);
    assert_eq!(bad(&mut bearer(&token(&ec, "e1", c))), Failure::Expired);
    let mut c = claims("https://idp.example");
    c["aud"] = json!("other");
    let f = bad(&mut bearer(&token(&ec, "e1", c)));
    assert_eq!((f, f.status().as_u16()), (Failure::Audience, 403));
    let mut c = claims("https://idp.example");
    c["nbf"] = json!(now() + 3600);
    assert_eq!(bad(&mut bearer(&token(&ec, "e1", c))), Failure::NotYetValid);
    let f = bad(&mut bearer(&token(
        &ec,
        "e1",
        claims("https://evil.example"),
    )));
    assert_eq!(
        (f, f.status().as_u16(), f.to_string().as_str()),
        (Failure::UnknownIssuer, 401, "Jwt issuer is not configured")
    );
    assert_eq!(
        bad(&mut bearer(&token(
            &ec,
            "nope",
            claims("https://idp.example")
        ))),
        Failure::NoMatchingKey
    );
    // Algorithm confusion: HS256 "signed" with the RSA key's public modulus.
    let mut h = Header::new(Algorithm::HS256);
    h.kid = Some("r1".into());
    let n = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(rsa.jwk["n"].as_str().unwrap())
        .unwrap();
    let hs = jsonwebtoken::encode(
        &h,
        &claims("https://idp.example"),
        &EncodingKey::from_secret(&n),
    )
    .unwrap();
    assert!(matches!(
        bad(&mut bearer(&hs)),
        Failure::NoMatchingKey | Failure::Signature
    ));
    assert_eq!(bad(&mut bearer("not.a-token")), Failure::BadFormat);
    assert_eq!(bad(&mut bearer("abc")), Failure::BadFormat);
    // A payload edited after signing.
    let t = token(&ec, "e1", claims("https://idp.example"));
    let mut parts: Vec<String> = t.split('.').map(String::from).collect();
    let mut c = claims("https://idp.example");
    c["sub"] = json!("admin");
    parts[1] = b64(c.to_string().as_bytes());
    assert_eq!(bad(&mut bearer(&parts.join("."))), Failure::Signature);
    // No token: passes on, unauthenticated.
    assert_eq!(auth(&a, &mut HeaderMap::new(), Some("x=1")), Ok(None));
}

#[test]
fn locations_outputs_and_forwarding() {
    let ec = ec_key("k");
    let t = token(&ec, "k", claims("iss1"));
    let a = ra(
        json!([{"issuer": "iss1", "jwks": jwks(&[&ec]), "fromHeaders": [{"name": "x-jwt", "prefix": "Token "}],
        "fromParams": ["tok"], "fromCookies": ["session"], "outputPayloadToHeader": "x-payload",
        "outputClaimToHeaders": [{"header": "x-team", "claim": "org.team.name"}, {"header": "x-level", "claim": "level"}]}]),
    );
    let mut h = HeaderMap::new();
    h.insert("x-jwt", format!("Token {t}").parse().unwrap());
    h.insert("x-team", "spoofed".parse().unwrap());
    let got = auth(&a, &mut h, None).unwrap().unwrap();
    assert_eq!(got.principal, "iss1/alice");
    assert!(h.get("x-jwt").is_none());
    assert_eq!(h.get("x-payload").unwrap(), t.split('.').nth(1).unwrap());
    assert_eq!(
        (
            h.get("x-team").unwrap().to_str().unwrap(),
            h.get("x-level").unwrap().to_str().unwrap()
        ),
        ("core", "3")
    );
    // The query parameter and the cookie.
    assert!(
        auth(&a, &mut HeaderMap::new(), Some(&format!("a=b&tok={t}")))
            .unwrap()
            .is_some()
    );
    let mut h = HeaderMap::new();
    h.insert("cookie", format!("a=b; session={t}").parse().unwrap());
    assert!(auth(&a, &mut h, None).unwrap().is_some());
    // Not where this rule looks (the default Authorization header): no token; a
    // client-sent output header does not survive.
    let mut h = bearer(&t);
    h.insert("x-team", "spoofed".parse().unwrap());
    assert_eq!(auth(&a, &mut h, None), Ok(None));
    assert!(h.get("x-team").is_none());
    // forwardOriginalToken keeps it; the default locations include access_token.
    let fwd = ra(json!([{"issuer": "iss1", "jwks": jwks(&[&ec]), "forwardOriginalToken": true}]));
    let mut h = bearer(&t);
    assert!(auth(&fwd, &mut h, None).unwrap().is_some());
    assert!(h.get("authorization").is_some());
    assert!(auth(
        &fwd,
        &mut HeaderMap::new(),
        Some(&format!("access_token={t}"))
    )
    .unwrap()
    .is_some());
    // Every token must verify: a good one does not carry a bad one.
    let mut c = claims("iss1");
    c["exp"] = json!(1);
    let expired = token(&ec, "k", c);
    let mut h = bearer(&t);
    assert_eq!(
        auth(&fwd, &mut h, Some(&format!("access_token={expired}"))),
        Err(Failure::Expired)
    );
}

#[test]
fn providers_combine_and_jwks_uri_needs_a_fetch() {
    let (k1, k2) = (ec_key("a"), ec_key("b"));
    // Two policies, the same issuer: one with an audience the token lacks, one without.
    let p1 = ra(json!([{"issuer": "iss", "jwks": jwks(&[&k1]), "audiences": ["nope"]}]));
    let p2 = ra(
        json!([{"issuer": "iss", "jwks": jwks(&[&k1])}, {"issuer": "iss2", "jwksUri": "http://127.0.0.1:1/jwks"}]),
    );
    let store = JwksStore::new(JwksSettings::default());
    let mut h = bearer(&token(&k1, "a", claims("iss")));
    assert!(authenticate(&[&p1, &p2], &store, &mut h, None)
        .unwrap()
        .is_some());
    // Keys not fetched (yet): tokens of that issuer fail.
    let mut h = bearer(&token(&k2, "b", claims("iss2")));
    assert_eq!(
        authenticate(&[&p1, &p2], &store, &mut h, None),
        Err(Failure::JwksNotFetched)
    );
    // The stand-in for an unreadable RequestAuthentication refuses every token.
    let stand_in = RequestAuthentication::reject_all("default", "broken", &[]);
    let mut h = bearer(&token(&k1, "a", claims("iss")));
    assert_eq!(
        authenticate(&[&p2, &stand_in], &store, &mut h, None),
        Err(Failure::Signature)
    );
    assert_eq!(
        authenticate(&[&stand_in], &store, &mut HeaderMap::new(), None),
        Ok(None)
    );
}

#[test]
fn claims_as_policy_sees_them() {
    let a = RequestAuth::new(claims("iss"), vec!["scope".into()]);
    assert_eq!(a.claim(&["groups"]), Claim::Values(vec!["dev", "ops"]));
    assert_eq!(a.claim(&["scope"]), Claim::Values(vec!["read", "write"]));
    assert_eq!(
        a.claim(&["org", "team", "name"]),
        Claim::Values(vec!["core"])
    );
    assert_eq!(a.claim(&["org", "x"]), Claim::Missing);
    assert_eq!(a.claim(&["level"]), Claim::Unsupported);
    assert_eq!(a.claim(&["aud"]), Claim::Values(vec!["web", "api"]));
}

#[test]
fn validation_names_the_field() {
    let err = |rules: Value| {
        let a: RequestAuthentication = serde_json::from_value(json!({
            "name": "j", "namespace": "default", "targetRefs": [{"kind": "Service", "name": "echo"}], "jwtRules": rules})).unwrap();
        a.validate().unwrap_err()
    };
    assert!(err(json!([{"issuer": ""}])).starts_with("jwtRules[0].issuer:"));
    assert!(err(json!([{"issuer": "i"}]))
        .starts_with("jwtRules[0].jwksUri: required unless jwks is set or the issuer is a URL"));
    // A URL issuer without keys: OpenID discovery.
    let d: RequestAuthentication = serde_json::from_value(
        json!({"name": "j", "namespace": "d", "targetRefs": [{"kind": "Service", "name": "e"}],
        "jwtRules": [{"issuer": "https://idp.example"}]}),
    )
    .unwrap();
    d.validate().unwrap();
    assert_eq!(
        d.jwt_rules[0].jwks_source().as_deref(),
        Some("openid:https://idp.example")
    );
    assert!(
        err(json!([{"issuer": "i", "jwksUri": "ftp://x/k"}])).starts_with("jwtRules[0].jwksUri:")
    );
    assert!(err(json!([{"issuer": "i", "jwks": "{\"keys\": []}"}]))
        .starts_with("jwtRules[0].jwks: has no keys"));
    let bad: Result<RequestAuthentication, _> = serde_json::from_value(
        json!({"name": "j", "namespace": "d", "jwtRules": [{"issuer": "i", "jwks": "{}"}]}),
    );
    assert!(bad
        .unwrap_err()
        .to_string()
        .contains("not a JSON Web Key Set"));
    assert!(err(
        json!([{"issuer": "i", "jwksUri": "http://x/k", "fromHeaders": [{"name": "bad header"}]}])
    )
    .starts_with("jwtRules[0].fromHeaders[0].name:"));
    assert!(
        err(json!([{"issuer": "i", "jwksUri": "http://x/k", "timeout": "5 parsecs"}]))
            .starts_with("jwtRules[0].timeout:")
    );
    let a: RequestAuthentication =
        serde_json::from_value(json!({"name": "j", "namespace": "default", "jwtRules": []}))
            .unwrap();
    assert!(a
        .validate()
        .unwrap_err()
        .starts_with("targetRefs: required"));
}

/// The cost of one authenticated request's JWT check (decode, key lookup, signature,
/// claims, header rewrite): `cargo test -p waypoint --lib authn::tests::cost -- --ignored --nocapture`.
#[test]
#[ignore]
fn cost() {
    let (rsa, ec) = (rsa_key("r"), ec_key("e"));
    let a = ra(
        json!([{"issuer": "iss", "jwks": jwks(&[&rsa, &ec]), "outputClaimToHeaders": [{"header": "x-sub", "claim": "sub"}]}]),
    );
    let store = JwksStore::new(JwksSettings::default());
    for (name, k, kid) in [("RS256", &rsa, "r"), ("ES256", &ec, "e")] {
        let t = token(k, kid, claims("iss"));
        let n = 5000;
        let start = std::time::Instant::now();
        for _ in 0..n {
            let mut h = bearer(&t);
            assert!(authenticate(&[&a], &store, &mut h, None).unwrap().is_some());
        }
        println!(
            "{name}: {:.1} µs per request",
            start.elapsed().as_secs_f64() * 1e6 / n as f64
        );
    }
}

/// Hostile tokens, validly signed, whose registered claims are missing or of another
/// type than Envoy's parser accepts: none may pass a rule with audiences, and none may
/// make a token ageless (jsonwebtoken alone skipped both checks).
#[test]
fn tokens_without_aud_or_with_odd_claim_types_fail_as_in_envoy() {
    let ec = ec_key("e1");
    let a =
        ra(json!([{"issuer": "https://idp.example", "jwks": jwks(&[&ec]), "audiences": ["api"]}]));
    let bad = |c: Value| auth(&a, &mut bearer(&token(&ec, "e1", c)), None).unwrap_err();
    let with = |k: &str, v: Value| {
        let mut c = claims("https://idp.example");
        if v.is_null() {
            c.as_object_mut().unwrap().remove(k);
        } else {
            c[k] = v;
        }
        c
    };
    // No audience at all, or an empty list: not one of the rule's.
    let f = bad(with("aud", Value::Null));
    assert_eq!(
        (f, f.status().as_u16(), f.to_string().as_str()),
        (Failure::Audience, 403, "Audiences in Jwt are not allowed")
    );
    assert_eq!(bad(with("aud", json!([]))), Failure::Audience);
    // Not a string or a list of strings.
    for aud in [json!(7), json!({"x": "api"}), json!(["api", 1])] {
        let f = bad(with("aud", aud.clone()));
        assert_eq!(
            (f, f.status().as_u16()),
            (Failure::AudNotString, 401),
            "{aud}"
        );
    }
    // exp and nbf must be numbers: as strings they were not checked at all.
    let f = bad(with("exp", json!((now() - 3600).to_string())));
    assert_eq!(
        (f, f.to_string().as_str()),
        (
            Failure::ClaimNotInteger("exp"),
            "Jwt payload [exp] field is not an integer"
        )
    );
    assert_eq!(
        bad(with("nbf", json!((now() + 3600).to_string()))),
        Failure::ClaimNotInteger("nbf")
    );
    assert_eq!(bad(with("exp", json!(-5))), Failure::ClaimOutOfRange("exp"));
    assert_eq!(
        bad(with("iss", json!(["https://idp.example"]))),
        Failure::ClaimNotString("iss")
    );
    assert_eq!(bad(with("sub", json!(1))), Failure::ClaimNotString("sub"));
    // A fractional exp is a date too (Envoy reads whole seconds): an old one has expired.
    assert_eq!(
        bad(with("exp", json!((now() - 3600) as f64 + 0.5))),
        Failure::Expired
    );
    // Audiences compare as Envoy's: without the scheme and a trailing slash.
    let a = ra(
        json!([{"issuer": "https://idp.example", "jwks": jwks(&[&ec]), "audiences": ["https://api.example/"]}]),
    );
    let mut h = bearer(&token(&ec, "e1", with("aud", json!("api.example"))));
    assert!(auth(&a, &mut h, None).unwrap().is_some());
    // Without audiences in the rule, a token without aud passes (Envoy's too).
    let a = ra(json!([{"issuer": "https://idp.example", "jwks": jwks(&[&ec])}]));
    assert!(auth(
        &a,
        &mut bearer(&token(&ec, "e1", with("aud", Value::Null))),
        None
    )
    .unwrap()
    .is_some());
}
