// Who is signed in (from GET /api/v1/whoami): the role decides whether action buttons show.
export const session = { role: null, name: "" };
