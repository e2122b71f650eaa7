// The API browser of /docs: Swagger UI (vendored in /static/swagger/), reading Relay's own
// /openapi.json. Everything comes from Relay: no validator badge (it would load an image from
// validator.swagger.io), and the key typed in under "Authorize" is kept only by the page.
"use strict";

window.addEventListener("DOMContentLoaded", () => {
  window.ui = SwaggerUIBundle({
    url: "/openapi.json",
    dom_id: "#swagger-ui",
    deepLinking: true,
    validatorUrl: null,
    persistAuthorization: false,
  });
});
