"""What a dataset URI may carry (kspeed.uris): credentials are found, refused and never echoed."""

from __future__ import annotations

import pytest

from kspeed import uris
from kspeed.errors import ConfigError, ProtocolError

SECRET = "S3CRETPW"

CARRYING = [
    (f"http://alice:{SECRET}@data.example/imgs/", "user name and password"),
    (f"https://alice%3A{SECRET}@data.example/imgs/", "user name and password"),
    (f"s3://AKIAEXAMPLE:{SECRET}@bucket/train/", "user name and password"),
    (f"https://{SECRET}@github.example/org/data.tar", "user name"),
    (f"simplecache::https://alice:{SECRET}@data.example/x.npy", "user name and password"),
    (f"https://b.s3.example/x.tar?X-Amz-Algorithm=AWS4&X-Amz-Credential=K&X-Amz-Signature={SECRET}", "X-Amz-Signature"),
    (f"https://b.s3.example/x.tar?AWSAccessKeyId=K&Expires=1&Signature={SECRET}", "Signature"),
    (f"https://acct.blob.example/c/x.npy?sv=2022&se=2030&sp=r&sig={SECRET}", "'sig'"),
    (f"https://storage.example/b/x?X-Goog-Credential=K&X-Goog-Signature={SECRET}", "X-Goog-Signature"),
    (f"http://data.example/x.npy?token={SECRET}", "'token'"),
    (f"http://data.example/x.npy?a=1;API_KEY={SECRET}", "'API_KEY'"),
    (f"http://data.example/x.npy#access_token={SECRET}", "'access_token'"),
    (f"http://data.example/x.npy?X%2DAmz%2DSecurity%2DToken={SECRET}", "X-Amz-Security-Token"),
]


@pytest.mark.parametrize(("uri", "named"), CARRYING)
def test_credentials_are_found_named_and_never_shown(uri, named):
    found = uris.credentials(uri)
    assert named in found and SECRET not in found
    assert SECRET not in uris.redact(uri) and "***" in uris.redact(uri)
    with pytest.raises(ProtocolError) as refused:
        uris.check(uri, what="dataset 'imgs': uri")
    message = str(refused.value)
    assert SECRET not in message
    assert "dataset 'imgs': uri" in message and "backend_options" in message and "never in a URI" in message


@pytest.mark.parametrize(
    "uri",
    [
        "/data/imgs",
        "/data/user@host/imgs",  # a plain path has no user
        "file:///data/a@b/c.npy",
        "s3://bucket/train/a@v2.jpg",  # an '@' in the path, not in the authority
        "https://data.example/x.npy?versionId=3&download=1",
        "abfs://container@account.dfs.core.windows.net/train/",  # Azure's container@account
        "gs://bucket/train-{000..009}.tar",
    ],
)
def test_uris_without_credentials_pass_unchanged(uri):
    assert uris.credentials(uri) == ""
    assert uris.check(uri) == uri
    assert uris.redact(uri) == uri


def test_control_characters_and_length_are_refused_with_the_callers_error():
    with pytest.raises(ConfigError, match="holds a control character") as refused:
        uris.check("/data/x\n2024-01-01 INFO forged line", ConfigError, field="uri")
    assert refused.value.field == "uri"
    with pytest.raises(ProtocolError, match="1-4096 characters"):
        uris.check("/" + "x" * 4096)
    with pytest.raises(ProtocolError, match="1-4096 characters"):
        uris.check("")


def test_a_long_uri_is_shown_cut():
    shown = uris.redact("s3://bucket/" + "k" * 5000 + f"?token={SECRET}")
    assert len(shown) <= 203 and shown.endswith("...") and SECRET not in shown
