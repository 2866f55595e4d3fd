"""Training jobs as seen through their ranks' reports."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Path, Query

from controller.api.deps import AUTH_ERRORS, NOT_FOUND, Page, ServicesDep, require_viewer
from controller.auth import Principal
from controller.errors import NotFound
from controller.schemas import JobDetail, JobsPublic
from controller.services import queries
from controller.services.container import Services

router = APIRouter(tags=["jobs"])


@router.get("/jobs", operation_id="list_jobs", response_model=JobsPublic, responses=AUTH_ERRORS)
async def list_jobs(
    page: Page = Depends(),
    history: bool = Query(
        False,
        description="Every job the database holds, by name: those still in memory as "
        "they are now, those that left it (job_retention_s) as stored (state ended, "
        "source history). Without it, only the jobs in memory.",
    ),
    _principal: Principal = Depends(require_viewer),
    services: Services = ServicesDep,
) -> JobsPublic:
    state = services.state
    window = services.settings.node_lost_after_s
    if history:
        stored, count = await services.store.read(
            lambda s: queries.stored_jobs_page(s, limit=page.limit, offset=page.offset)
        )
        # Built here, on the loop: a job still in memory is shown as it is now.
        return JobsPublic(
            data=[
                queries.job_public(state, live, active_within_s=window)
                if (live := state.jobs.get(job.name)) is not None
                else queries.history_job_public(state, job, nodes)
                for job, nodes in stored
            ],
            count=count,
        )
    jobs = sorted(state.jobs.values(), key=lambda j: j.name)
    data = [
        queries.job_public(state, j, active_within_s=window)
        for j in jobs[page.offset : page.offset + page.limit]
    ]
    return JobsPublic(data=data, count=len(jobs))


@router.get(
    "/jobs/{name}",
    operation_id="get_job",
    response_model=JobDetail,
    responses={**AUTH_ERRORS, **NOT_FOUND},
)
async def get_job(
    name: str = Path(max_length=253),
    _principal: Principal = Depends(require_viewer),
    services: Services = ServicesDep,
) -> JobDetail:
    """A job in memory as it is now; one that left memory (``job_retention_s``) as the
    database last stored it (state ``ended``, source ``history``): yesterday's job is
    still there to look into, not a 404."""
    job = services.state.jobs.get(name)
    if job is None:
        stored = await services.store.read(lambda s: queries.stored_job(s, name))
        if stored is None:
            raise NotFound(f"job {name!r} not found")
        return queries.history_job_detail(services.state, stored)
    return queries.job_detail(
        services.state, job, active_within_s=services.settings.node_lost_after_s
    )
