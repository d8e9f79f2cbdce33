package apiv1

import _ "embed"

// OpenAPI is the OpenAPI 3.0 document of API v1 (openapi.json in this folder), served
// by the server at GET /v1/openapi.json.
//
//go:embed openapi.json
var OpenAPI []byte
